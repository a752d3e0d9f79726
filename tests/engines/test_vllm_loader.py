"""``--load-format tierstore`` in a real vLLM engine (f)."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_helpers import prompt, run_engine

pytest.importorskip("vllm")


def test_tierstore_load_format_from_s3_matches_auto(tiny_model, tmp_path, s3_server):
    """The weights come from S3 through tierstore.weights (ranges cached in a disk tier; the model has
    tied embeddings); greedy outputs equal vLLM's default loader reading the local directory."""
    fs = s3_server.filesystem()
    bucket = s3_server.new_bucket()
    fs.put(str(Path(tiny_model) / "model.safetensors"), f"{bucket}/llama/model.safetensors")
    options = {k: v for k, v in s3_server.storage_options.items() if k != "skip_instance_cache"}
    prompts = [prompt(7, 40), prompt(8, 90)]
    auto = run_engine({"model": tiny_model, "prompts": prompts, "load_format": "auto"})
    extra = {"uri": f"s3://{bucket}/llama", "storage_options": options,
             "store": {"tiers": [{"kind": "disk", "path": str(tmp_path / "weights-cache"), "capacity": "64MiB"}]}}
    ours = run_engine({"model": tiny_model, "prompts": prompts, "load_format": "tierstore", "loader_extra": extra,
                       "inprocess": False})
    assert [r["tokens"] for r in ours["results"]] == [r["tokens"] for r in auto["results"]]
    assert list((tmp_path / "weights-cache").rglob("*.tso")), "S3 ranges were cached on local disk"
