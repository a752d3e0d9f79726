"""Model-based test of the store under real thread interleavings (review B.3: the state machine is single-threaded).

Several threads run seeded random operations — put and put_many (overwriting), get and get_many, a tier's
get_many with repeated keys, delete, prefetch, flush and forced evictions — against a 3-tier store whose
top tier holds two chunks, so eviction races write-back all the time, while the middle tier refuses some
writes. A 1 µs switch interval makes the interpreter switch threads inside the windows the write-back
bugs needed.

The model: every key has one owner thread (the only one that puts or deletes it), so the owner knows the
last value it put. Checked throughout:

* a read never returns bytes that were never written for that key (by anyone);
* the owner always reads back its last put exactly (nothing acknowledged is lost, nothing stale served);
* write-back never gives a key up (no tier holding it) unless its owner deleted it behind its back;
* after a flush, the owner's keys read back exactly; after the final flush, the bottom tier holds them.
"""

from __future__ import annotations

import errno
import logging
import random
import sys
import threading
import time

import pytest
import torch

import tierstore
from tierstore import errors
from tierstore.testing.data import chunk, key_of

N_THREADS = 4
KEYS_PER_THREAD = 3
OPS_PER_THREAD = 250
CHUNK = 8000
FILLER = 10_000  # key ids of chunks put straight into the top tier to force evictions


def value(n: int, version: int) -> dict[str, torch.Tensor]:
    return chunk(n * 1000 + version, CHUNK)


def version_of(got: dict[str, torch.Tensor], n: int, written: set[int]) -> int:
    """The version of key ``n`` that ``got`` holds; fails if it is none that was ever written."""
    for v in written:
        expected = value(n, v)
        if all(torch.equal(got[name], expected[name]) for name in expected):
            return v
    raise AssertionError(f"key {n}: bytes of no version ever written ({sorted(written)})")


class Run:
    def __init__(self, store: tierstore.TieredStore, seed: int) -> None:
        self.store = store
        self.seed = seed
        self.written: dict[int, set[int]] = {}  # key -> versions ever put (recorded before the put starts)
        self.latest: dict[int, int | None] = {}  # key -> the owner's last put version; None = deleted
        self.ever_deleted: set[int] = set()
        self.flaky = True
        self.lock = threading.Lock()

    def keys_of(self, w: int) -> list[int]:
        return [w * KEYS_PER_THREAD + i for i in range(KEYS_PER_THREAD)]

    def check_read(self, n: int, got: dict[str, torch.Tensor] | None, owner: bool) -> None:
        with self.lock:
            written = set(self.written.get(n, ()))
        latest = self.latest.get(n)
        if got is None:
            assert not owner or latest is None, f"key {n}: the owner's last put (v{latest}) was lost"
            return
        v = version_of(got, n, written)
        if owner and latest is not None:
            assert v == latest, f"key {n}: read v{v}, the owner last put v{latest}"

    def worker(self, w: int) -> None:
        rng = random.Random(self.seed * 100 + w)
        s = self.store
        mine = self.keys_of(w)
        all_keys = [n for t in range(N_THREADS) for n in self.keys_of(t)]
        version = 0
        for _ in range(OPS_PER_THREAD):
            op = rng.choices(["put", "put_many", "get", "get_other", "get_many", "store_get_many", "prefetch",
                              "delete", "flush", "evict"], [24, 6, 15, 15, 5, 5, 8, 4, 4, 14])[0]
            if op == "put":
                n = rng.choice(mine)
                version += 1
                with self.lock:
                    self.written.setdefault(n, set()).add(version)
                s.put(key_of(n), value(n, version))
                self.latest[n] = version
            elif op == "put_many":  # the batched store API keeps put's guarantees
                batch = []
                for n in rng.sample(mine, 2):
                    version += 1
                    with self.lock:
                        self.written.setdefault(n, set()).add(version)
                    batch.append((n, version))
                assert s.put_many([(key_of(n), value(n, v)) for n, v in batch]) == [True, True]
                for n, v in batch:
                    self.latest[n] = v
            elif op == "store_get_many":
                ns = [rng.choice(all_keys) for _ in range(3)] + [rng.choice(mine)]
                for n, got in zip(ns, s.get_many([key_of(n) for n in ns]), strict=True):
                    self.check_read(n, got, owner=n in mine)
            elif op in ("get", "get_other"):
                n = rng.choice(mine if op == "get" else all_keys)
                self.check_read(n, s.get(key_of(n)), owner=n in mine)
            elif op == "get_many":  # one tier's storage, read straight (any version of the key, or nothing)
                tier = rng.choice(s.tiers)
                ns = [rng.choice(all_keys) for _ in range(3)]
                ns.append(ns[0])  # a repeated key
                for n, got in zip(ns, tier.backend.read_many([key_of(n) for n in ns]), strict=True):
                    assert not isinstance(got, BaseException), got
                    self.check_read(n, None if got is None else got.value, owner=False)
            elif op == "prefetch":
                ns = rng.sample(all_keys, 3)
                assert 0 <= s.prefetch([key_of(n) for n in ns]).result(timeout=60) <= 3
            elif op == "delete":
                n = rng.choice(mine)
                self.latest[n] = None
                self.ever_deleted.add(n)
                s.delete(key_of(n))
            elif op == "flush":
                try:
                    s.flush(timeout=60)
                except errors.WriteBackError as exc:  # only the flaky middle tier may fail
                    assert all(tiers == ("middle",) for tiers in exc.failed.values()), exc.failed
                    continue
                for n in mine:
                    self.check_read(n, s.get(key_of(n)), owner=True)
            else:  # evict: a filler chunk into the top tier pushes the least recently used out
                s.put(key_of(FILLER + rng.randrange(4)), chunk(FILLER, CHUNK))


def int_of(key: object) -> int:
    for n in range(N_THREADS * KEYS_PER_THREAD):
        if key_of(n) == key:
            return n
    return -1


def make_store(tmp_path, pool: bool) -> tierstore.TieredStore:
    return tierstore.open({"tiers": [
        {"kind": "host", "capacity": 2 * 8192, "pinned": False, "pool": pool, "slot_size": 8192},
        {"kind": "device", "device": "cpu", "name": "middle", "capacity": 5 * 8192},
        {"kind": "disk", "path": str(tmp_path / "disk")},
    ], "max_in_flight": 3})


def make_flaky(run: Run, tier) -> None:
    """About one write in eight into ``tier`` fails with EIO (at its backend, so the store counts and handles
    it like a real I/O error) while ``run.flaky`` holds."""
    backend = tier.backend
    original, rng, lock = backend.write_many, random.Random(run.seed), threading.Lock()

    def write_many(items):
        items = list(items)
        with lock:
            fail = [run.flaky and rng.random() < 0.125 for _ in items]
        written = iter(original([it for it, f in zip(items, fail, strict=True) if not f]))
        return [OSError(errno.EIO, "injected write failure") if f else next(written) for f in fail]

    backend.write_many = write_many


class GiveUpWatch(logging.Handler):
    """Write-back gives a tier up only when no tier holds the value: fine for a key its owner deleted,
    a loss otherwise (a later put of the key would hide it from the final checks, so catch it here)."""

    def __init__(self, run: Run) -> None:
        super().__init__(logging.WARNING)
        self.run = run
        self.losses: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "given up" in msg:
            n = next((n for n in self.run.latest if key_of(n).hex() in msg), None)
            if n is not None and self.run.latest.get(n) is not None:
                self.losses.append(f"key {n} (owner's last put v{self.run.latest[n]}): {msg}")


@pytest.mark.parametrize("pool", [False, True], ids=["host-plain", "host-pool"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_threads_against_the_model(tmp_path, seed, pool):
    store = make_store(tmp_path, pool)
    run = Run(store, seed)
    make_flaky(run, store.tier("middle"))
    store._transfers.pin_wait = 0.5
    errors_seen: list[BaseException] = []
    watch = GiveUpWatch(run)
    logging.getLogger("tierstore").addHandler(watch)

    def guarded(w: int) -> None:
        try:
            run.worker(w)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors_seen.append(exc)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=guarded, args=(w,)) for w in range(N_THREADS)]
        start = time.monotonic()
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
        assert not any(th.is_alive() for th in threads), "a worker hung"
    finally:
        sys.setswitchinterval(old)
        logging.getLogger("tierstore").removeHandler(watch)
    assert not errors_seen, errors_seen[0]
    assert not watch.losses, watch.losses
    run.flaky = False

    def flush() -> None:
        try:
            store.flush(timeout=60)
        except errors.WriteBackError as exc:  # nothing fails once the middle tier is healthy
            raise AssertionError(exc.failed) from exc

    flush()
    bottom = store.tier("disk")
    for n, latest in run.latest.items():
        if latest is None:
            continue
        run.check_read(n, store.get(key_of(n)), owner=True)
        run.check_read(n, bottom.backend.read(key_of(n)), owner=True)  # flush brought it all the way down
    time.sleep(0.2)  # those reads promote what they found below (jobs) ...
    flush()  # ... and write-back fills the tiers between
    for name, st in store.stats()["tiers"].items():
        assert st["pinned"] == 0 and st["reserved_bytes"] == 0, (name, st)
        assert st["capacity_bytes"] is None or st["used_bytes"] <= st["capacity_bytes"]
    assert store.stats()["pending_writeback"] == 0
    store.close()
    assert time.monotonic() - start < 120
