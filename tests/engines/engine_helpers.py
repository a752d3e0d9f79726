"""Helpers of the engine tests: prompts, connector configs, running one engine in a fresh process."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
ENGINE_TIMEOUT_S = 300


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 1000) for _ in range(n)]


def kv_config(tiers: list[dict], connector: str = "TierstoreConnector",
              module: str = "tierstore_vllm", **extra) -> dict:
    return {"kv_connector": connector, "kv_connector_module_path": module, "kv_role": "kv_both",
            "kv_connector_extra_config": {"config": {"tiers": tiers}, **extra}}


def run_engine(spec: dict, record: Path | None = None, timeout: float = ENGINE_TIMEOUT_S) -> dict:
    """Run one engine in a fresh process (``engine_run.py``) and return its result dict."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=str(HERE))
    if record is not None:
        env["TIERSTORE_TEST_RECORD"] = str(record)
    proc = subprocess.run([sys.executable, str(HERE / "engine_run.py"), json.dumps(spec)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
        raise AssertionError(f"engine failed (rc={proc.returncode}):\n{tail}")
    return json.loads(lines[-1][len("RESULT "):])


def read_record(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines()] if path.exists() else []
