"""A real Prometheus server on 127.0.0.1 for tests: scrapes the given targets every second, answers PromQL.

Needs Debian's ``prometheus`` package (``make test`` installs it; :func:`prometheus_binary` says how).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from typing import Any

from .s3 import free_port, stop_process, wait_answering

INSTALL_HINT = "apt-get install prometheus (Debian's package; `make test` does it)"


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


class Prometheus:
    """``with Prometheus(["127.0.0.1:9400"]) as prom: prom.query("up")``."""

    def __init__(self, targets: list[str], metrics_path: str = "/metrics", interval_ms: int = 1000) -> None:
        binary = prometheus_binary()
        if binary is None:
            raise RuntimeError(f"prometheus not found: {INSTALL_HINT}")
        self.dir = tempfile.mkdtemp(prefix="tierstore-prometheus-")
        self.port = free_port()
        every = f"{int(interval_ms)}ms"
        config = {"global": {"scrape_interval": every, "evaluation_interval": every},
                  "scrape_configs": [{"job_name": "tierstore", "metrics_path": metrics_path,
                                      "static_configs": [{"targets": targets}]}]}
        path = os.path.join(self.dir, "prometheus.yml")
        with open(path, "w") as f:
            json.dump(config, f)  # JSON is YAML
        self._log = open(os.path.join(self.dir, "prometheus.log"), "wb")  # noqa: SIM115 - lives with the server
        self.proc = subprocess.Popen(
            [binary, f"--config.file={path}", f"--storage.tsdb.path={self.dir}/data",
             f"--web.listen-address=127.0.0.1:{self.port}"], stdout=self._log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"
        try:
            wait_answering(self.url + "/-/ready", self.proc, 30.0, "prometheus")
        except RuntimeError as exc:
            self.close()
            raise RuntimeError(f"{exc}: {self.log()[-2000:]}") from None

    def log(self) -> str:
        with open(os.path.join(self.dir, "prometheus.log"), "rb") as f:
            return f.read().decode(errors="replace")

    def query(self, promql: str) -> list[dict[str, Any]]:
        """The instant vector (``[{"metric": {...}, "value": [t, "v"]}, ...]``) of ``promql``."""
        url = self.url + "/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(url, timeout=5) as r:
            body = json.load(r)
        if body.get("status") != "success":
            raise RuntimeError(f"query {promql!r} failed: {body}")
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def wait_for(self, promql: str, check: Any, timeout: float = 30.0) -> list[dict[str, Any]]:
        """Poll ``promql`` until ``check(result)`` is true; the result, or ``TimeoutError`` with the last one."""
        deadline = time.monotonic() + timeout
        result: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            result = self.query(promql)
            if check(result):
                return result
            time.sleep(0.25)
        raise TimeoutError(f"{promql!r} never satisfied the check in {timeout}s; last result {result}")

    def close(self) -> None:
        stop_process(self.proc)
        self._log.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Prometheus:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def values(result: list[dict[str, Any]], label: str) -> dict[str, float]:
    """``{series[label]: value}`` of an instant vector."""
    return {s["metric"].get(label, ""): float(s["value"][1]) for s in result}
