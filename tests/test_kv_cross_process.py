"""Cross-instance KV sharing: two OS processes, each with its own host and disk tiers, one remote tier.

Process A prefills a prefix with the tiny model and saves its KV; process B (another interpreter, another
PYTHONHASHSEED, its own empty disk directory) finds the chunks on the shared tier, loads them bit-exactly
and continues the prompt with logits bit-identical to the same split computed without the store.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("kv_worker.py")
PREFIX, PROMPT, CHUNK = 83, 120, 16  # 5 full chunks saved (80 tokens), 3 trailing tokens not stored


def run_worker(spec: dict, hashseed: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if hashseed is not None:
        env["PYTHONHASHSEED"] = hashseed
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(WORKER.parent.parent), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, str(WORKER), json.dumps(spec)], env=env, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def instance_config(tmp_path: Path, name: str, remote: dict) -> dict:
    return {"tiers": [{"kind": "host", "capacity": "32MiB"},
                      {"kind": "disk", "path": str(tmp_path / name / "disk"), "capacity": "128MiB"},
                      remote],
            "write_policy": "write_back"}


def share(tmp_path: Path, remote: dict, dtype: str) -> tuple[dict, dict]:
    common = {"dtype": dtype, "prompt_len": PROMPT, "seed": 5}
    a = run_worker({**common, "mode": "save", "prefix_len": PREFIX,
                    "config": instance_config(tmp_path, "a", remote)}, hashseed="1")
    b = run_worker({**common, "mode": "load", "config": instance_config(tmp_path, "b", remote)},
                   hashseed="random")
    return a, b


def check(a: dict, b: dict, tol: float) -> None:
    stored = PREFIX - PREFIX % CHUNK
    assert a["pid"] != b["pid"] and b["hashseed"] == "random"
    assert a["written"] == stored
    assert b["hit"] == stored, b
    assert b["keys"] == a["keys"]  # same keys in both processes, no PYTHONHASHSEED agreement needed
    assert b["tiers"] == ["remote"] * (stored // CHUNK)  # B's own host and disk started empty
    assert b["digest"] == a["digest"]  # the bytes B loaded are the bytes A saved
    assert b["kv_equal"] and b["logits_equal"]
    assert b["max_abs_diff_vs_full"] <= tol
    assert b["other_hits"] == {"model": 0, "dtype": 0, "rank": 0, "tenant": 0}


@pytest.mark.slow
def test_share_through_local_s3(tmp_path, s3_server, s3_bucket):
    remote = {"kind": "remote", "url": f"s3://{s3_bucket}/kv", "storage_options": s3_server.storage_options}
    a, b = share(tmp_path, remote, "bfloat16")
    check(a, b, tol=5e-2)
    objects = s3_server.filesystem().find(f"{s3_bucket}/kv")
    assert sum(1 for o in objects if o.endswith(".tso")) == PREFIX // CHUNK


@pytest.mark.slow
def test_share_through_shared_directory(tmp_path):
    shared = tmp_path / "nfs"
    shared.mkdir()
    a, b = share(tmp_path, {"kind": "remote", "url": f"file://{shared}"}, "float32")
    check(a, b, tol=1e-4)
    assert (tmp_path / "a" / "disk").is_dir() and (tmp_path / "b" / "disk").is_dir()
