import sys
from pathlib import Path

# tierstore_vllm is its own distribution (adapters/vllm); the fake-driver tests import it from the tree.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "adapters" / "vllm"))
