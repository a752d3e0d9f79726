"""The guide's deployment started from Python: ``examples/deploy/launch.sh`` (two vLLM API servers and
``vllm-router``) in its own session, for the benchmarks and the engine tests.

Needs the repository checkout (the script lives in ``examples/deploy``), vLLM and ``vllm-router`` (and
LMCache for ``KV=lmcache-mp``: ``make lmcache-peer``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from ..testing.s3 import free_port

LAUNCH = Path(__file__).resolve().parents[2] / "examples" / "deploy" / "launch.sh"
#: sitecustomize for the engines of the LMCache configuration (see its docstring)
VLLM_CPU_FIX = Path(__file__).resolve().parent / "vllm_cpu_fix"
#: engine settings that fit this project's 2-core CPU machines (override with ENGINE_ARGS)
CPU_ENGINE_ARGS = "--enforce-eager --dtype bfloat16 --max-num-seqs 4 --seed 0 --gpu-memory-utilization 0.15"


def beside_python(command: str) -> str:
    """The path of ``command`` installed in this Python's environment (which may not be on PATH)."""
    return str(Path(sys.executable).with_name(command))


def router_binary() -> str | None:
    """``vllm-router`` on PATH or beside this Python, or None."""
    found = shutil.which("vllm-router") or beside_python("vllm-router")
    return found if os.access(found, os.X_OK) else None


class Deployment:
    """``launch.sh`` running with ``env`` (its settings: MODEL, SHARED, KV, ENGINE_ARGS ...) on free ports,
    state under ``state``; ready when constructed (raises ``RuntimeError`` with the logs otherwise)."""

    def __init__(self, env: Mapping[str, str], state: Path, timeout: float = 900.0):
        if not LAUNCH.exists():
            raise RuntimeError(f"{LAUNCH} not found: starting the deployment needs the repository checkout")
        router = router_binary()
        if router is None:
            raise RuntimeError("vllm-router is not installed (pip install vllm-router)")
        self.ports = {"a": free_port(), "b": free_port(), "router": free_port()}
        self.state = state
        lmcache = env.get("KV") == "lmcache-mp"
        if lmcache and not os.access(beside_python("lmcache"), os.X_OK):
            raise RuntimeError("LMCache is not installed beside this Python (make lmcache-peer)")
        full = {**os.environ, "VLLM_SERVE": f"{sys.executable} -m vllm.entrypoints.openai.api_server --model",
                "ROUTER": router, "ROUTER_ARGS": f"--prometheus-port {free_port()}", "STATE_DIR": str(state),
                "PORT_A": str(self.ports["a"]), "PORT_B": str(self.ports["b"]),
                "ROUTER_PORT": str(self.ports["router"]), "READY_TIMEOUT": str(int(timeout)),
                "TIERSTORE": beside_python("tierstore"), "LMCACHE": beside_python("lmcache"),
                "LMCACHE_PORT": str(free_port()), "EVENTS_A": str(free_port()), "EVENTS_B": str(free_port()),
                "KV_EVENT_BLOCK_SIZE": "128", **env}  # vllm-cpu's block size
        if lmcache:  # vllm-cpu needs a fix to run with LMCache imported
            full["PYTHONPATH"] = os.pathsep.join(filter(None, [str(VLLM_CPU_FIX), os.environ.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(["bash", str(LAUNCH)], env=full, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.output: list[str] = []
        deadline = time.monotonic() + 2 * timeout
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)
            if line.startswith("ready:") or time.monotonic() > deadline:
                break
        if not self.output or not self.output[-1].startswith("ready:"):
            self.close()
            raise RuntimeError("the deployment did not come up:\n" + "".join(self.output) + self.logs())

    def url(self, name: str) -> str:
        """``a``, ``b`` (the engines) or ``router``."""
        return f"http://127.0.0.1:{self.ports[name]}"

    def logs(self, lines: int = 40) -> str:
        out = []
        for name in ("a", "b", "router"):
            log = self.state / f"{name}.log"
            if log.exists():
                out.append(f"--- {name}.log\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(out)

    def close(self) -> int | None:
        """Stop the servers and the router (the script's own shutdown); returns the script's exit status."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> Deployment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
