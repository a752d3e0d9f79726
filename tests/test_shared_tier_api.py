"""Shared tiers in the API (review turn 4, #10 and #11): a delete a shared tier could not carry out is
reported per key and not counted (the copy stays indexed, and reads agree with the answer); evict never
removes a shared object; an unknown tier name is a named InvalidInputError."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
from test_data_plane_faults import failing

import tierstore
from tierstore.testing.data import assert_same, chunk, key_of

CHUNK = 8000


def refused() -> OSError:
    return OSError(errno.ECONNREFUSED, "Connection refused")


def open_store(tmp_path: Path) -> tierstore.TieredStore:
    return tierstore.open({"tiers": [{"kind": "host", "capacity": "1MiB", "pinned": False},
                                     {"kind": "remote", "url": f"file://{tmp_path}/remote"}]})


def test_a_delete_the_shared_tier_could_not_carry_out_is_reported_not_counted(tmp_path: Path) -> None:
    k, v = key_of(0), chunk(0, CHUNK)
    with open_store(tmp_path) as s:
        assert s.put(k, v)
        s.flush(timeout=30)
        remote = s.tier("remote").backend
        remote.delete_many = lambda keys: [OSError(errno.ECONNREFUSED, "Connection refused") for _ in keys]
        assert s.delete(k) == 0, "the remote kept its copy: the key was not deleted"
        assert s.delete_many([k]) == [False]
        assert s.holders(k) == ["host", "remote"]  # not deleted: the remote kept its copy, the host keeps its own
        assert_same(s.get(k), v)  # reads agree with the answer: not deleted
        del remote.delete_many
        assert s.delete_many([k, key_of(1)]) == [True, True]
        assert s.get(k) is None
    with open_store(tmp_path) as other:
        assert other.get(k) is None


def test_evict_refuses_a_shared_tier_and_names_an_unknown_one(tmp_path: Path) -> None:
    k, v = key_of(0), chunk(0, CHUNK)
    with open_store(tmp_path) as a, open_store(tmp_path) as b:
        assert a.put(k, v)
        a.flush(timeout=30)
        with pytest.raises(tierstore.InvalidInputError, match="shared"):
            a.evict(k, tier="remote")
        assert_same(b.get(k), v)  # every other process still reads it
        with pytest.raises(tierstore.InvalidInputError, match="nope"):
            a.evict(k, tier="nope")
        with pytest.raises(tierstore.InvalidInputError, match="host"):
            a.tier("nope")
        assert a.evict(k, tier="host") == 1  # a demotion: the remote keeps it
        assert_same(a.get(k), v)


def test_a_delete_the_shared_tier_refused_leaves_the_latest_value_never_an_older_one(tmp_path: Path) -> None:
    """``delete`` answers False when the shared tier could not remove its copy (an outage): the key was not
    deleted. Every reader then finds the key's latest value (here, after the outage, in another process), never
    the older value the shared tier still held: the tiers above it keep theirs and its write-back is still owed."""
    k, v1, v2 = key_of(0), chunk(1, CHUNK), chunk(2, CHUNK)
    with open_store(tmp_path) as s:
        assert s.put(k, v1)
        s.flush(timeout=30)
        remote = s.tier("remote").backend
        with failing(remote, "delete_many", refused), failing(remote, "write_many", refused):
            assert s.put(k, v2)  # the remote still holds v1: v2 waits for write-back
            assert s.delete_many([k]) == [False]
            assert_same(s.get(k), v2)  # not deleted: the latest value
        s.flush(timeout=30)  # the outage is over: v2 reaches the remote
        assert_same(s.get(k), v2)
    with open_store(tmp_path) as other:
        assert_same(other.get(k), v2)


def test_a_delete_a_middle_tier_refused_restores_the_tiers_below_it(tmp_path: Path) -> None:
    """Tiers are cleared slowest first: when the disk refuses (after the remote removed its copy), the key is
    not deleted, and the remote gets its value back by write-back: it stays readable everywhere, and the host's
    copy is never mistaken for a clean one (evicting it would lose the only copy)."""
    k, v = key_of(0), chunk(0, CHUNK)
    tiers = [{"kind": "host", "capacity": 3 * CHUNK, "pinned": False},
             {"kind": "disk", "path": str(tmp_path / "disk")},
             {"kind": "remote", "url": f"file://{tmp_path}/remote"}]
    with tierstore.open({"tiers": tiers}) as s:
        assert s.put(k, v)
        s.flush(timeout=30)
        with failing(s.tier("disk").backend, "delete_many", refused):
            assert s.delete_many([k]) == [False]
        assert s.holders(k) == ["host", "disk"]
        s.flush(timeout=30)
        assert s.holders(k) == ["host", "disk", "remote"]
    with open_store(tmp_path) as other:
        assert_same(other.get(k), v)
