"""A remote tier is never stuck: a real S3 server (moto) behind the fault-injecting shim.

Each test makes the endpoint sick in one way (refuse, reset, blackhole, slow, 5xx, 403) and checks that
store calls come back within a bound — a miss, not a stall — that the tier then backs off without
touching the network, and that it recovers once the endpoint heals. Calls run under a watchdog thread,
so a regression fails the test in seconds instead of hanging it for minutes.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest

import tierstore
from tierstore.backends.base import Hit
from tierstore.backends.fsspec import FsspecBackend
from tierstore.backends.guarded import DEFAULT_TIMEOUT, S3_CLIENT_DEFAULTS, Unavailable
from tierstore.bench.s3shim import S3Shim
from tierstore.errors import ClosedError
from tierstore.testing.data import assert_same, chunk, key_of
from tierstore.transfers import Tier

SLACK = 4.0  # seconds on top of a deadline: thread start-up and a busy two-core CI machine


def within(limit: float, fn: Callable[[], Any]) -> tuple[Any, float]:
    """Run ``fn`` and return ``(result, seconds)``; fail if it has not returned after ``limit`` seconds
    (the call is left running on a daemon thread: the old code blocked for minutes)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = fn()
        except BaseException as exc:  # handed to the test thread
            out["error"] = exc

    start = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit)
    elapsed = time.monotonic() - start
    assert not thread.is_alive(), f"still blocked after {elapsed:.1f}s (limit {limit:.1f}s)"
    if "error" in out:
        raise out["error"]
    return out["result"], elapsed


@pytest.fixture
def prefix(s3_server, shim):
    """``(url, options through the shim, options straight to moto)`` for a fresh prefix holding key 1."""
    bucket = s3_server.new_bucket("faults")
    url = f"s3://{bucket}/kv-{uuid.uuid4().hex[:8]}"
    direct = s3_server.storage_options
    with FsspecBackend(url=url, storage_options=direct) as writer:  # another engine published key 1
        writer.write(key_of(1), chunk(1))
    shim.set_fault("pass")
    yield url, shim.storage_options(direct), direct
    shim.set_fault("pass")


def open_store(url: str, options: dict, **remote: Any) -> tierstore.TieredStore:
    return tierstore.open({"tiers": [{"kind": "host", "capacity": "16MiB"},
                                     {"kind": "remote", "url": url, "storage_options": options, **remote}]})


def remote_tier(store: tierstore.TieredStore) -> Tier:
    tier = store.tier("remote")
    assert isinstance(tier.backend, FsspecBackend)
    return tier


def remote_stats(store: tierstore.TieredStore) -> dict[str, Any]:
    return store.stats()["tiers"]["remote"]


@pytest.mark.parametrize("mode", ["blackhole", *(pytest.param(m, marks=pytest.mark.slow)
                                                 for m in ("reset", "refuse", "status"))])
def test_sick_endpoint_is_a_bounded_miss_then_fails_fast_then_recovers(prefix, shim, mode):
    """Probe rows 7.2-7.4: a blackhole blocked one get for 408 s, resets for 48.8 s (default settings)."""
    url, options, _ = prefix
    with open_store(url, options, list_on_open=False) as store:  # key 1 is known to no index here
        storage = remote_tier(store).backend.storage
        storage.retry_after = 3.0  # long enough that the calls below all fall inside one back-off
        shim.set_fault(mode)
        got, took = within(DEFAULT_TIMEOUT + SLACK, lambda: store.get(key_of(1)))
        assert got is None
        requests = shim.stats()["requests"]
        for call in (lambda: store.get(key_of(1)), lambda: store.lookup([key_of(1)]),
                     lambda: store.where(key_of(1)), lambda: store.contains(key_of(1))):
            result, fast = within(1.0 + SLACK, call)
            assert not result
        assert shim.stats()["requests"] == requests  # backing off: no request reached the endpoint
        stats = remote_stats(store)
        assert stats["errors"] >= 1 and stats["corrupt"] == 0 and stats["backoff_s"] >= 3.0
        assert stats["failures"].get("down") == 1  # one outage, reported once
        shim.set_fault("pass")
        time.sleep(storage.retry_after + 0.2)
        got, _ = within(DEFAULT_TIMEOUT + SLACK, lambda: store.get(key_of(1)))
        assert_same(got, chunk(1))  # healed: the same store hits again


def test_slow_endpoint_within_the_deadline_still_serves(prefix, shim):
    url, options, _ = prefix
    with open_store(url, options, timeout=1.0) as store:
        shim.set_fault("slow", delay=0.3)
        got, _ = within(1.0 + SLACK, lambda: store.get(key_of(1)))
        assert_same(got, chunk(1))
    with open_store(url, options, timeout=1.0) as store:  # a fresh process: key 1 not in its host tier
        shim.set_fault("slow", delay=30.0)
        got, _ = within(1.0 + SLACK, lambda: store.get(key_of(1)))
        assert got is None
        assert remote_stats(store)["errors"] >= 1


def test_put_and_close_during_a_blackhole_are_bounded(prefix, shim):
    """Probe row 7.5: close() with dirty chunks during a blackhole was still blocked after 580 s."""
    url, options, direct = prefix
    store = open_store(url, options, timeout=1.0)
    shim.set_fault("blackhole")
    for i in range(10, 30):
        store.put(key_of(i), chunk(i))
    _, took = within(2 * 1.0 + SLACK, store.close)
    shim.set_fault("pass")
    with FsspecBackend(url=url, storage_options=direct, list_on_open=False) as check:
        # whatever reached S3 before the outage is exact; the rest is absent
        got = check.read_many([key_of(i) for i in range(10, 30)])
        for i, g in zip(range(10, 30), got, strict=True):
            assert g is None or (isinstance(g, Hit) and all(g.value[n].equal(v) for n, v in chunk(i).items()))


def test_backend_close_does_not_wait_for_stuck_requests(prefix, shim):
    url, options, _ = prefix
    backend = FsspecBackend(url=url, storage_options=options, timeout=2.0, max_in_flight=4)
    shim.set_fault("blackhole")
    outcome: list[object] = []

    def read() -> None:
        try:
            outcome.append(backend.read_many([key_of(i) for i in range(100, 140)]))
        except ClosedError as exc:  # its queued lookups were dropped by close()
            outcome.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    time.sleep(0.3)  # the pool is busy with requests nobody will answer
    within(2.0 + SLACK, backend.close)
    reader.join(2.0 + SLACK)
    assert not reader.is_alive() and len(outcome) == 1
    # the lookups nobody answered: each item failed (timed out, or refused while backing off), none found
    assert isinstance(outcome[0], ClosedError) or (
        len(outcome[0]) == 40 and all(isinstance(r, (TimeoutError, Unavailable)) for r in outcome[0])), outcome
    with pytest.raises(ClosedError):
        backend.read_many([key_of(1)])


def test_server_errors_back_off(prefix, shim):
    url, options, _ = prefix
    with FsspecBackend(url=url, storage_options=options, list_on_open=False) as backend:
        backend.storage.retry_after = 3.0
        shim.set_fault("status", status=503)
        (got,), _ = within(DEFAULT_TIMEOUT + SLACK, lambda: backend.read_many([key_of(1)]))
        assert isinstance(got, OSError) and not isinstance(got, Unavailable)  # the 503, after botocore's retries
        requests = shim.stats()["requests"]
        (err,) = backend.write_many([(key_of(2), backend.prepare(key_of(2), chunk(2)))])
        (again,) = backend.read_many([key_of(1)])
        assert isinstance(err, Unavailable) and isinstance(again, Unavailable)
        assert backend.stat_many([key_of(1)]) == [None]
        assert shim.stats()["requests"] == requests  # a failing service is given a rest
        assert backend.stats()["backoff_s"] >= 3.0


def test_head_denied_without_list_permission_is_a_quiet_miss(prefix, shim, caplog):
    """S3 answers 403 for a missing key when the caller lacks s3:ListBucket: a miss, not an error storm."""
    caplog.set_level(logging.WARNING, logger="tierstore")
    url, options, _ = prefix
    with open_store(url, options, list_on_open=False) as store:
        backend = remote_tier(store).backend
        shim.set_fault("status", status=403, methods=["HEAD"])
        for i in range(20, 30):
            assert not store.contains(key_of(i))
        assert backend.stat_many([key_of(i) for i in range(30, 35)]) == [None] * 5
        assert store.get(key_of(20)) is None
        stats = remote_stats(store)
        assert stats["errors"] == 0 and stats["backoff_s"] == 0
        assert set(stats["failures"]) == {"head-403"}, stats["failures"]  # not one lookup counted as failed
        assert len([r for r in caplog.records if "denied" in r.getMessage()]) == 1
        shim.set_fault("pass")
        assert store.contains(key_of(1))  # the tier never backed off: a 403 is an answer


def test_client_timeouts_default_and_can_be_overridden(s3_server):
    url = f"s3://{s3_server.new_bucket('cfg')}/kv"
    with FsspecBackend(url=url, storage_options=s3_server.storage_options, list_on_open=False) as backend:
        # one connection per request in flight
        assert backend.fs.config_kwargs == {**S3_CLIENT_DEFAULTS, "max_pool_connections": 32}
        assert backend.timeout == backend.storage.timeout == DEFAULT_TIMEOUT
    options = {**s3_server.storage_options, "config_kwargs": {"read_timeout": 30}}
    with FsspecBackend(url=url, storage_options=options, list_on_open=False, timeout=60, max_in_flight=4) as backend:
        assert backend.fs.config_kwargs == {**S3_CLIENT_DEFAULTS, "read_timeout": 30, "max_pool_connections": 4}
        assert backend.timeout == backend.storage.timeout == 60
    assert options["config_kwargs"] == {"read_timeout": 30}  # the caller's mapping is not modified
    options = {**s3_server.storage_options, "config_kwargs": {"max_pool_connections": 2}}
    with FsspecBackend(url=url, storage_options=options, list_on_open=False) as backend:
        assert backend.fs.config_kwargs["max_pool_connections"] == 2  # the user's value wins


@pytest.mark.slow  # starts two proxies
def test_fault_shim_stops_itself(s3_server):
    """The proxy never outlives its bound: ``lifetime`` seconds, or its parent closing the control pipe."""
    timed = S3Shim(s3_server.endpoint_url, latency=0.0, bandwidth=0, lifetime=1.0)
    orphan = S3Shim(s3_server.endpoint_url, latency=0.0, bandwidth=0)
    try:
        orphan.set_fault("blackhole")
        assert orphan.proc.stdin is not None
        orphan.proc.stdin.close()  # what the parent's exit does
        assert orphan.proc.wait(10) == 0
        assert timed.proc.wait(10) == 0
    finally:
        timed.close()
        orphan.close()
