"""Promotion under pressure and faults (review turn 4, #6, #7 and the prefetch error that vanished): admission
is bounded and deduplicated, a promotion holds the top tier's slot only once it holds the bytes, and a read
error during a prefetch is raised, logged and counted."""

from __future__ import annotations

import errno
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import tierstore
from tierstore.testing.data import assert_same, chunk, key_of

CHUNK = 8000
SLOT = 8192 + 512


def in_promoter() -> bool:
    return threading.current_thread().name.startswith("tierstore-promote")


def slowed(backend: Any, seconds: float, started: threading.Event) -> None:
    """``backend``'s reads take ``seconds`` longer on the promotion workers (a slow remote GET)."""
    for name in ("read_many", "read_objects"):
        original = getattr(backend, name)

        def slow(keys: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            if in_promoter():
                started.set()
                time.sleep(seconds)
            return _original(keys, *args, **kwargs)

        setattr(backend, name, slow)


def test_a_put_never_waits_behind_a_promotions_read_of_the_same_key(tmp_path: Path) -> None:
    """#7: a prefetch reads K's older value from a slow remote; a put of K meanwhile returns at once into the
    top tier, and the promotion does not land the older value over it."""
    url = f"file://{tmp_path}/remote"
    k, v1, v2 = key_of(0), chunk(1, CHUNK), chunk(2, CHUNK)
    with tierstore.open({"tiers": [{"kind": "remote", "url": url}]}) as other:
        assert other.put(k, v1)
    config = {"tiers": [{"kind": "host", "capacity": 4 * SLOT, "pinned": False}, {"kind": "remote", "url": url}]}
    with tierstore.open(config) as s:
        started = threading.Event()
        slowed(s.tier("remote").backend, 1.5, started)
        promoted = s.prefetch([k])
        assert started.wait(10)
        start = time.monotonic()
        assert s.put(k, v2)
        took = time.monotonic() - start
        promoted.result(10)
        assert took < 1.0, f"the put waited {took:.2f}s behind the promotion"
        assert s.where(k) == "host"
        assert_same(s.get(k), v2)
        s.flush(timeout=30)
        assert_same(s.get(k), v2)


def test_promotion_admission_is_bounded_when_the_top_tier_is_pinned(tmp_path: Path) -> None:
    """#6: every chunk of the host tier is pinned, and reads keep finding chunks on the disk: those reads admit
    no promotion that could only wait for room (counted as skipped), so the queue stays bounded."""
    config = {"tiers": [{"kind": "host", "capacity": 4 * SLOT, "pinned": False},
                        {"kind": "disk", "path": str(tmp_path / "disk")}]}
    with tierstore.open(config) as s:
        s._transfers.pin_wait = 0.5  # noqa: SLF001
        below = [key_of(i) for i in range(10, 18)]
        for i, k in enumerate(below):
            assert s.put(k, chunk(i, CHUNK))
        s.flush(timeout=30)
        top = [key_of(i) for i in range(4)]
        for i, k in enumerate(top):
            assert s.put(k, chunk(i, CHUNK))
        assert all(s.where(k) == "disk" for k in below)
        pin = s.pin(top)
        try:
            most = 0
            for _ in range(300):
                got = s.get_many(below)
                assert all(g is not None for g in got)
                running = [j for j in s.stats()["jobs"]["running"] if j["kind"] == "promote"]
                most = max(most, len(running))
            assert most <= 2 * s.max_in_flight, f"{most} promotion jobs queued behind pinned memory"
            assert s.stats().get("promotions_skipped", 0) > 0
        finally:
            s.release(pin)
        s.get_many(below[:2])  # room again: promotion goes on
        s.flush(timeout=30)


def test_a_read_error_during_a_prefetch_is_raised_logged_and_counted(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """The prefetch error that vanished: the disk cannot read K (EIO) while it is promoted for a prefetch."""
    config = {"tiers": [{"kind": "host", "capacity": 4 * SLOT, "pinned": False},
                        {"kind": "disk", "path": str(tmp_path / "disk")}]}
    with tierstore.open(config) as s:
        k = key_of(0)
        assert s.put(k, chunk(0, CHUNK))
        s.flush(timeout=30)
        assert s.evict(k, tier="host") == 1
        disk = s.tier("disk").backend
        for name in ("read_many", "read_objects"):
            setattr(disk, name, lambda keys, *a, **kw: [OSError(errno.EIO, "Input/output error") for _ in keys])
        with pytest.raises(OSError):
            s.prefetch([k]).result(10)
        assert s.stats()["prefetch_errors"] == 1
        assert any("prefetch failed" in r.getMessage() for r in caplog.records)
        del disk.read_many, disk.read_objects
        assert s.prefetch([k]).result(10) == 1
