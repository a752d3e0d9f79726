"""A real S3 endpoint on 127.0.0.1 for tests and benchmarks: ``moto_server`` in a subprocess.

Credentials and region travel in :attr:`LocalS3.storage_options` and in the server's own environment;
this process's ``os.environ`` is left alone (setting ``AWS_*`` there would override the user's real
credentials for everything else the process does).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any


def stop_process(proc: subprocess.Popen[Any], timeout: float = 10) -> None:
    """Terminate a helper server, killing it if it has not exited within ``timeout`` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_answering(url: str, proc: subprocess.Popen[Any], timeout: float, what: str) -> None:
    """Poll ``url`` until it answers 2xx; ``RuntimeError`` if ``proc`` exits or ``timeout`` s pass first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode}")
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{what} did not answer on {url} within {timeout}s")


REGION = "us-east-1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class LocalS3:
    """A running local S3 server; ``storage_options`` feeds s3fs / fsspec."""

    endpoint_url: str
    process: subprocess.Popen[bytes]
    buckets: list[str] = field(default_factory=list)

    @property
    def storage_options(self) -> dict[str, Any]:
        return {"endpoint_url": self.endpoint_url, "key": "testing", "secret": "testing",
                "skip_instance_cache": True}

    def filesystem(self) -> Any:
        import s3fs
        return s3fs.S3FileSystem(**self.storage_options)

    def new_bucket(self, prefix: str = "tierstore") -> str:
        """Create a fresh bucket and return its name."""
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        self.filesystem().mkdir(name)
        self.buckets.append(name)
        return name

    def stop(self) -> None:
        stop_process(self.process)


def _moto_command(port: int) -> list[str]:
    exe = shutil.which("moto_server", path=os.path.dirname(sys.executable)) or shutil.which("moto_server")
    if exe:
        return [exe, "-H", "127.0.0.1", "-p", str(port)]
    return [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]


def start_local_s3(timeout: float = 30.0) -> LocalS3:
    """Start ``moto_server`` on a free loopback port and wait until it answers."""
    port = free_port()
    env = {**os.environ, "AWS_DEFAULT_REGION": REGION, "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing"}
    proc = subprocess.Popen(_moto_command(port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_answering(url + "/moto-api/", proc, timeout, "moto_server")
    except RuntimeError:
        stop_process(proc)
        raise
    return LocalS3(url, proc)


@contextmanager
def local_s3() -> Iterator[LocalS3]:
    server = start_local_s3()
    try:
        yield server
    finally:
        server.stop()
