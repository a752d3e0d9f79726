import sys
from pathlib import Path

# tierstore_vllm and tierstore_sglang are their own distributions (adapters/<engine>); the fake-driver
# tests import them from the tree.
_ADAPTERS = Path(__file__).resolve().parents[2] / "adapters"
for _engine in ("vllm", "sglang"):
    sys.path.insert(0, str(_ADAPTERS / _engine))
