import os

import pytest

os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")


@pytest.fixture(scope="session")
def s3_server():
    """A real S3 endpoint (moto_server) on 127.0.0.1, shared by the session."""
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
