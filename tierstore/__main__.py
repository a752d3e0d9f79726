"""``python -m tierstore``: the same command line as ``tierstore``."""

import sys

from .cli import main

sys.exit(main())
