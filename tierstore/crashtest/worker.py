"""The crash test's writer: a forked process that opens a store, reports what survived, then writes until killed.

The driver forks it from a process that has imported torch and tierstore but never opened a store, so each
writer is fresh as far as the store is concerned (its own tiers, lock, threads and index) and starts in
milliseconds. It first reads every key from every durable tier and writes what it found to
``observed.json``: that is the check of the previous incarnation's kill. Then its threads put, overwrite,
read and flush their own keys and read each other's, journaling each step (:mod:`tierstore.crashtest.journal`),
until SIGKILL.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, NoReturn

import torch

from ..backends import Hit
from ..config import WritePolicy
from ..keys import ChunkKey
from ..residency import Room
from ..store import TieredStore
from ..store import open_tiered as open_store
from ..tensors import TensorDict, byte_alias
from .journal import JournalWriter, Observed

#: tier kinds whose contents survive the process; host and device tiers lose un-flushed data by design
DURABLE_KINDS = ("disk", "remote")
#: deliberately broken writers, to show the checker catches them (``drop-dirty``: tiers evict dirty chunks
#: without writing them below, as if the store ignored its own write-back)
SABOTAGE = ("ack-before-put", "corrupt-value", "drop-dirty")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class WorkerSpec:
    """What one writer incarnation does (plain data: the driver forks, nothing is serialised)."""

    config: Mapping[str, Any]  #: store config
    journal: str
    observed: str  #: where the check of what survived is written (JSON, atomically)
    keys: int  #: size of the key space; thread ``t`` owns keys ``t, t + threads, ...``
    threads: int
    seed: int
    start_seq: int  #: first sequence number of this incarnation's puts
    flaky_remote: float = 0.0  #: share of the remote tier's writes that fail (the drop policy's pressure)
    faults: float = 0.0  #: share of the disk tier's reads and removals that fail (EIO) once the check is done
    max_batch: int = 24  #: write_back: a thread flushes after 1..max_batch of its puts
    check_only: bool = False
    #: ``sys.setswitchinterval`` for the writer: tiny values make thread switches (and races) far more frequent
    switch_interval: float | None = None
    sabotage: str | None = None  #: one of :data:`SABOTAGE`, or ``None`` for an honest writer
    reserve: bool = False  #: put by reservation (reserve, fill the pool memory, commit)


def crash_key(index: int) -> ChunkKey:
    return ChunkKey.from_bytes(b"tierstore crashtest key %d" % index)


def make_chunk(seed: int) -> TensorDict:
    """A deterministic two-tensor chunk of 0.5-64 KiB per tensor, its dtype and size drawn from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    rows = int(torch.randint(4, 257, (1,), generator=g))
    dtype = _DTYPES[seed % len(_DTYPES)]
    return {"k": torch.randn(rows, 64, generator=g).to(dtype), "v": torch.randn(rows, 64, generator=g).to(dtype)}


def content_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    return ChunkKey.from_tensors(tensors).hex()


def observe(store: TieredStore, keys: list[ChunkKey]) -> dict[str, Observed]:
    """What each durable tier holds for each key (content digest or ``None``), in store order."""
    found: dict[str, Observed] = {}
    for tier in store.tiers:
        if tier.kind in DURABLE_KINDS:
            found[tier.name] = {k.hex(): content_digest(got.value) if isinstance(got, Hit) else None
                                for k, got in zip(keys, tier.backend.read_many(keys), strict=True)}
    return found


def fork_worker(spec: WorkerSpec, log_path: str) -> int:
    """Fork a writer running ``spec``; its stdout and stderr go to ``log_path``. Returns its pid."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the driver, which then kills this writer
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        log_fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        null_fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null_fd, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        run_worker(spec)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_worker(spec: WorkerSpec) -> None:
    """Open the store, report what survived, then (unless ``check_only``) write until killed."""
    if spec.switch_interval is not None:
        sys.setswitchinterval(spec.switch_interval)
    store = open_store(spec.config)
    if spec.sabotage == "drop-dirty":
        _evict_without_writing_down(store)
    if spec.flaky_remote:
        _refuse_some_writes(store.tier("remote"), spec.flaky_remote, random.Random(spec.seed))
    keys = [crash_key(i) for i in range(spec.keys)]
    tmp = f"{spec.observed}.tmp"
    with open(tmp, "w") as f:
        json.dump(observe(store, keys), f)
    os.replace(tmp, spec.observed)
    if spec.check_only:
        store.close()
        return
    if spec.faults:
        _fail_some_reads_and_removals(store.tier("disk"), spec.faults, random.Random(spec.seed + 1))
    _Writer(store, spec, keys).run()


def _evict_without_writing_down(store: TieredStore) -> None:
    """Sabotage: victims are evicted as if clean, dirty or not (their write-downs never happen)."""
    reserve = store.residency.reserve

    def sabotaged(key: ChunkKey, tier: int, size: int, clean: bool = False) -> Room:
        room = reserve(key, tier, size, clean)
        return replace(room, victims=tuple(replace(v, down=None) for v in room.victims))

    store.residency.reserve = sabotaged  # type: ignore[method-assign]


def _refuse_some_writes(tier: Any, share: float, rng: random.Random) -> None:
    """Make ``tier``'s backend refuse about ``share`` of the chunks written to it (as a remote under an outage
    does), tensors and encoded objects alike."""
    backend = tier.backend
    write = backend.write_many

    def flaky(items: Any) -> list[BaseException | None]:
        items = list(items)
        take = [rng.random() >= share for _ in items]
        stored = iter(write([item for item, t in zip(items, take, strict=True) if t]) if any(take) else [])
        return [next(stored) if t else OSError("refused (crash test: a flaky remote)") for t in take]

    backend.write_many = flaky


def _fail_some_reads_and_removals(tier: Any, share: float, rng: random.Random) -> None:
    """Make ``tier``'s backend fail about ``share`` of the keys it is asked to read or remove with EIO (a disk
    going bad): write-downs, write-back sources and evictions meet errors, and must keep every chunk."""
    import errno

    backend = tier.backend

    def flaky(method: Any) -> Any:
        def call(keys: Any, *args: Any, **kwargs: Any) -> list[Any]:
            keys = list(keys)
            fail = [rng.random() < share for _ in keys]
            done = iter(method([k for k, f in zip(keys, fail, strict=True) if not f], *args, **kwargs)
                        if not all(fail) else [])
            return [OSError(errno.EIO, "Input/output error (crash test: a failing disk)") if f else next(done)
                    for f in fail]
        return call

    for name in ("read_objects", "read_many", "delete_many"):
        setattr(backend, name, flaky(getattr(backend, name)))


class _Writer:
    def __init__(self, store: TieredStore, spec: WorkerSpec, keys: list[ChunkKey]):
        self.store, self.spec, self.keys = store, spec, keys
        self.journal = JournalWriter(spec.journal)
        self._lock = threading.Lock()
        self._next_seq = spec.start_seq
        self._write_back = store.write_policy is WritePolicy.WRITE_BACK

    def run(self) -> NoReturn:
        """Write from ``threads`` threads until killed (or until the driver is gone: then exit)."""
        driver = os.getppid()
        for t in range(self.spec.threads):
            threading.Thread(target=self._thread, args=(t,), daemon=True).start()
        while os.getppid() == driver:
            time.sleep(0.2)
        os._exit(3)

    def _thread(self, tid: int) -> None:
        try:
            self._loop(tid)
        except BaseException as exc:  # a writer that stops by itself is a finding: say why, then exit
            self.journal.append({"op": "error", "error": f"{type(exc).__name__}: {exc}"}, sync=True)
            traceback.print_exc()
            os._exit(2)

    def _loop(self, tid: int) -> None:
        rng = random.Random(self.spec.seed * 1009 + tid)
        own = range(tid, self.spec.keys, self.spec.threads)
        last: dict[int, str] = {}  # key index -> digest this thread last put
        unacked: list[tuple[int, str]] = []
        batch = rng.randint(1, self.spec.max_batch)
        ack_first = self.spec.sabotage == "ack-before-put"  # broken: acknowledge, then put, never flush
        while True:
            index = rng.choice(own)
            if rng.random() < 0.2:
                self._get(index, last.get(index))
                continue
            if rng.random() < 0.1:  # another thread's key: a promotion that may race that thread's put
                self.store.get(self.keys[rng.randrange(self.spec.keys)])
                continue
            seq, digest = self._put(tid, index, ack_first)
            if ack_first:
                continue
            if digest is None:  # refused (the put said so): the key keeps an earlier value or none
                last.pop(index, None)
                continue
            last[index] = digest
            if not self._write_back:
                self.journal.append({"op": "ack", "t": tid, "seqs": [seq]}, sync=True)
                continue
            unacked.append((seq, self.keys[index].hex()))
            if len(unacked) >= batch:
                self._flush(tid, unacked)
                unacked, batch = [], rng.randint(1, self.spec.max_batch)

    def _put(self, tid: int, index: int, ack_first: bool) -> tuple[int, str | None]:
        """Put a new value of key ``index``: its sequence number and digest (``None``: no tier took it)."""
        with self._lock:
            seq, self._next_seq = self._next_seq, self._next_seq + 1
        tensors = make_chunk(self.spec.keys + seq)
        digest = content_digest(tensors)
        if self.spec.sabotage == "corrupt-value":
            byte_alias(tensors["k"])[0] ^= 1
        key = self.keys[index]
        self.journal.append({"op": "put", "seq": seq, "key": key.hex(), "digest": digest})
        if ack_first:
            self.journal.append({"op": "ack", "t": tid, "seqs": [seq]}, sync=True)
        if not self._store_one(key, tensors) and not ack_first:
            return seq, None
        return seq, digest

    def _store_one(self, key: ChunkKey, tensors: TensorDict) -> bool:
        if not self.spec.reserve:
            return self.store.put(key, tensors)
        with self.store.reserve([(key, tensors)]) as reservation:
            (views,) = reservation.tensors
            if views is None:  # nothing reserved (no room in time): the ordinary put
                return self.store.put(key, tensors)
            for name, t in tensors.items():
                views[name].copy_(t)
            (ok,) = reservation.commit()
            return ok

    def _get(self, index: int, expected: str | None) -> None:
        """A read of one of this thread's keys must return its last put (or miss: that is checked at the kill)."""
        data = self.store.get(self.keys[index])
        if data is not None and expected is not None and (got := content_digest(data)) != expected:
            self.journal.append({"op": "wrong", "key": self.keys[index].hex(), "digest": got, "expected": expected})

    def _flush(self, tid: int, puts: list[tuple[int, str]]) -> None:
        self.journal.append({"op": "flush", "t": tid})
        try:
            report = self.store.flush()
        except Exception as exc:  # e.g. WriteBackError: these puts are not acknowledged
            self.journal.append({"op": "flush_failed", "t": tid, "error": f"{type(exc).__name__}: {exc}"})
            return
        dropped = {k.hex() for k in report.dropped}
        if dropped:
            self.journal.append({"op": "dropped", "t": tid, "seqs": [s for s, k in puts if k in dropped]})
        self.journal.append({"op": "ack", "t": tid, "seqs": [s for s, k in puts if k not in dropped]}, sync=True)
