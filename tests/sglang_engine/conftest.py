"""SGLang's real classes on this CPU: run by ``make test-sglang`` (its own venv), skipped by ``make test``."""

from __future__ import annotations

import os

if not os.environ.get("TIERSTORE_SGLANG_TESTS"):
    collect_ignore_glob = ["test_*.py"]  # `make test`: SGLang is not installed there
