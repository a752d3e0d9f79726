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


def tier_kv_config(tier: dict, cpu_bytes: int = 64 << 20, **extra) -> dict:
    """vLLM's OffloadingConnector with ``CPUTieringOffloadingSpec`` (vLLM's tiering spec with a CPU worker), a CPU
    tier of ``cpu_bytes`` and the secondary tier ``tier`` (a ``secondary_tiers`` entry)."""
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"spec_name": "CPUTieringOffloadingSpec", "spec_module_path": "tierstore_vllm",
                                          "cpu_bytes_to_use": cpu_bytes, "secondary_tiers": [tier], **extra}}


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


def complete(url: str, model: str, ids: list[int], max_tokens: int = 4) -> dict:
    """One greedy completion of the token ids ``ids`` from the OpenAI-compatible server (or router) at ``url``."""
    import urllib.request

    body = json.dumps({"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=ENGINE_TIMEOUT_S) as r:
        return json.load(r)


def counter(base: str, family: str) -> dict[str, float]:
    """``{labels: value}`` of one counter family on a server's /metrics."""
    import re
    import urllib.request

    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return {m.group(1) or "": float(m.group(2))
            for m in re.finditer(rf"^{family}(\{{[^}}]*\}})? ([0-9.e+]+)$", text, re.M)}


class ApiServer:
    """``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1 (vllm-cpu's ``vllm`` CLI does not start),
    with the engine settings of ``engine_run.py``; ``complete(ids)`` sends one greedy completion."""

    def __init__(self, model: str, port: int, kv: dict | None = None, log: Path | None = None,
                 timeout: float = ENGINE_TIMEOUT_S, extra_args: list[str] | None = None):
        from tierstore.testing.s3 import wait_answering

        self.model, self.port = model, port
        self.url = f"http://127.0.0.1:{port}"
        args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
                "--port", str(port), "--enforce-eager", "--max-model-len", "1024", "--dtype", "bfloat16",
                "--max-num-seqs", "4", "--max-num-batched-tokens", "1024", "--seed", "0",
                "--gpu-memory-utilization", "0.15"]
        if kv is not None:
            args += ["--kv-transfer-config", json.dumps(kv)]
        args += extra_args or []
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=str(HERE))
        self._log_path = log
        self._log = open(log, "wb") if log is not None else subprocess.DEVNULL  # noqa: SIM115 - lives with the server
        self.proc = subprocess.Popen(args, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        try:
            wait_answering(self.url + "/health", self.proc, timeout, "the API server")
        except RuntimeError as exc:
            self.close()
            raise AssertionError(f"{exc}:\n{self.log_tail()}") from None

    def log_tail(self, lines: int = 60) -> str:
        if self._log_path is None:
            return ""
        return "\n".join(self._log_path.read_text(errors="replace").splitlines()[-lines:])

    def complete(self, ids: list[int], max_tokens: int = 4) -> dict:
        return complete(self.url, self.model, ids, max_tokens)

    def close(self) -> None:
        from tierstore.testing.s3 import stop_process

        stop_process(self.proc, timeout=60)
        if self._log is not subprocess.DEVNULL:
            self._log.close()

    def __enter__(self) -> ApiServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
