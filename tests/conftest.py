import importlib.util
import os
import re

import pytest

os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")

#: packages tierstore or its tests need that a bare GPU machine may lack (the GPU check kit installs only zstandard):
#: a test module whose import fails for want of one is skipped, naming it, instead of failing collection (one
#: collection error stops the whole run, so nothing would be tested).
MAY_BE_MISSING = ("blake3", "prometheus_client", "moto", "s3fs", "boto3", "botocore", "aiohttp", "cryptography",
                  "matplotlib")
_MISSING = re.compile(r"No module named '([\w.]+)'")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if report.failed and isinstance(collector, pytest.Module):
        m = _MISSING.search(str(report.longrepr))
        root = m.group(1).split(".")[0] if m else ""
        if root in MAY_BE_MISSING and importlib.util.find_spec(root) is None:
            report.outcome = "skipped"
            report.longrepr = (str(collector.path), 0, f"Skipped: needs {m.group(1)}, which is not installed")


@pytest.fixture(scope="session")
def s3_server():
    """A real S3 endpoint (moto_server) on 127.0.0.1, shared by the session."""
    pytest.importorskip("moto.server", reason="needs moto[server] (the local S3 endpoint)")
    pytest.importorskip("s3fs")
    from tierstore.testing.s3 import start_local_s3

    server = start_local_s3()
    yield server
    server.stop()


@pytest.fixture
def s3_bucket(s3_server):
    """A fresh, empty bucket on the local S3 server."""
    return s3_server.new_bucket()


@pytest.fixture(scope="module")
def shim(s3_server):
    """A pass-through S3 shim (no added latency) in front of the local S3 server: counts requests and
    injects faults (:class:`tierstore.bench.s3shim.S3Shim`); one per test module."""
    from tierstore.bench.s3shim import S3Shim

    with S3Shim(s3_server.endpoint_url, latency=0.0, bandwidth=0, lifetime=900) as s:
        yield s


@pytest.fixture
def hashes(monkeypatch):
    """Counts the checksums started (xxh3_128 objects made: a write's, a verified read's), for the tests of
    ``verify_reads: once``."""
    from tierstore.backends import file_reads

    made = []
    real = file_reads.xxhash.xxh3_128
    monkeypatch.setattr(file_reads.xxhash, "xxh3_128", lambda *a: made.append(1) or real(*a))
    return made
