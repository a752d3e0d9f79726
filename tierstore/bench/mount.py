"""``tierstore bench mount``: one request's load from a shared mount while other requests' chunks are stored.

In an engine under vLLM's native offloading a load (the prefix of a request that waits for it) meets the stores
of the requests before it on the same disk. Per configuration, ``--chunks`` chunks of ``--chunk-mib`` MiB are
loaded into page-aligned memory (as vLLM's CPU tier) ``--loads`` times, 0.2 s apart, while ``--writers`` threads
store batches of ``--chunks`` new chunks in a loop:

* ``tierstore``: a ``remote`` tier on ``file://`` (``get_many(out=)``, ``put_many`` from page-aligned rows, as
  ``TierstoreTier`` calls them; checksums written and verified);
* ``fs``: vLLM's ``fs`` secondary tier's own I/O (``batch_load_block``/``batch_store_block`` on its
  ``DualQueueThreadPool`` of 16 load-priority and 16 store-priority threads), when vLLM is importable;
* ``alone`` rows: the same loads with no writer (the disk's own time for them).

Configurations alternate, ``--repeats`` times; medians of every load. Loaded bytes are compared with the stored
ones after each configuration.
"""

from __future__ import annotations

import argparse
import itertools
import json
import mmap
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..cliargs import nonneg_int, positive_int
from ..keys import ChunkKey


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chunks", type=positive_int, default=19, help="chunks per load and per stored batch (default 19)")
    p.add_argument("--chunk-mib", type=positive_int, default=8, help="MiB per chunk (default 8)")
    p.add_argument("--writers", type=nonneg_int, default=4, help="threads storing batches meanwhile (default 4)")
    p.add_argument("--loads", type=positive_int, default=15,
                   help="loads timed per configuration and repeat (default 15)")
    p.add_argument("--repeats", type=positive_int, default=2, help="rounds over the configurations (default 2)")
    p.add_argument("--dir", default=None, help="a directory on the disk to measure (default: a temporary one)")
    p.add_argument("--json", default=None, help="also write the results as JSON here")


class _Rows:
    """Page-aligned rows (vLLM's CPU tier is one shared mmap): the loaded chunks, the source, and one set per
    writer."""

    def __init__(self, chunks: int, size: int, writers: int) -> None:
        self.n, self.size = chunks, size
        self.buf = mmap.mmap(-1, (2 + writers) * chunks * size)
        self.view = memoryview(self.buf)
        self.rows = torch.frombuffer(self.buf, dtype=torch.uint8).view(-1, size)
        self.rows[chunks:].random_(0, 256, generator=torch.Generator().manual_seed(0))

    def load_rows(self) -> range:
        return range(self.n)

    def source_rows(self) -> range:
        return range(self.n, 2 * self.n)

    def writer_rows(self, w: int) -> range:
        return range((2 + w) * self.n, (3 + w) * self.n)

    def loaded_equal_source(self) -> bool:
        return bool(self.rows[:self.n].equal(self.rows[self.n:2 * self.n]))


class _Tierstore:
    name = "tierstore"

    def __init__(self, root: Path, rows: _Rows) -> None:
        import tierstore

        self.rows = rows
        self.store = tierstore.open({"tiers": [{"kind": "remote", "url": f"file://{root}"}]})
        self.keys = [ChunkKey.from_bytes(b"mount-bench-%d" % i) for i in range(rows.n)]
        self._put(self.keys, rows.source_rows())

    def _put(self, keys: list[ChunkKey], rows: range) -> None:
        if not all(self.store.put_many([(k, {"kv": self.rows.rows[r]}) for k, r in zip(keys, rows, strict=True)])):
            raise RuntimeError("tierstore: a put was refused")

    def store_batch(self, w: int, n: int) -> None:
        self._put([ChunkKey.from_bytes(b"mount-bench-w%d-%d" % (n, i)) for i in range(self.rows.n)],
                  self.rows.writer_rows(w))

    def load(self) -> None:
        got = self.store.get_many(self.keys, out=[{"kv": self.rows.rows[r]} for r in self.rows.load_rows()])
        if any(g is None for g in got):
            raise RuntimeError("tierstore: a load missed")

    def close(self) -> None:
        self.store.close()


class _Fs:
    name = "fs"

    def __init__(self, root: Path, rows: _Rows) -> None:
        from vllm.v1.kv_offload.tiering.fs import io as fsio
        from vllm.v1.kv_offload.tiering.fs.thread_pool import DualQueueThreadPool

        self.io, self.rows, self.root = fsio, rows, root
        root.mkdir(parents=True, exist_ok=True)
        self.pool = DualQueueThreadPool(16, 16, thread_name_prefix="bench_fs")
        self.jobs = itertools.count()
        self.paths = [str(root / f"c{i}") for i in range(rows.n)]
        fsio.batch_store_block(self.paths, rows.view, self._offsets(rows.source_rows()), rows.size, True)

    def _offsets(self, rows: range) -> list[int]:
        return [r * self.rows.size for r in rows]

    def _run(self, enqueue: Callable[..., None], task: Callable[[], None]) -> None:
        done = threading.Event()
        failed: list[BaseException] = []

        def job() -> None:
            try:
                task()
            except BaseException as exc:  # the pool logs and swallows it: hand it to the caller
                failed.append(exc)
                raise
            finally:
                done.set()

        enqueue(next(self.jobs), 1, [job])
        done.wait()
        if failed:
            raise failed[0]

    def store_batch(self, w: int, n: int) -> None:
        paths = [str(self.root / f"w{n}-{i}") for i in range(self.rows.n)]
        self._run(self.pool.enqueue_store, lambda: self.io.batch_store_block(
            paths, self.rows.view, self._offsets(self.rows.writer_rows(w)), self.rows.size, True))

    def load(self) -> None:
        self._run(self.pool.enqueue_load, lambda: self.io.batch_load_block(
            self.paths, self.rows.view, self._offsets(self.rows.load_rows()), self.rows.size, True))

    def close(self) -> None:
        self.pool.shutdown()


def _loads_under_writes(tier: Any, writers: int, loads: int) -> dict[str, Any]:
    """Seconds of each of ``loads`` loads while ``writers`` threads store batches, and the batches stored."""
    stop = threading.Event()
    batches, stored = itertools.count(), itertools.count()  # names of batches, batches stored
    errors: list[BaseException] = []

    def write(w: int) -> None:
        try:
            while not stop.is_set():
                tier.store_batch(w, next(batches))
                next(stored)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(w,), daemon=True) for w in range(writers)]
    for t in threads:
        t.start()
    if writers:
        time.sleep(1.0)  # the writers are under way
    seconds = []
    start = time.perf_counter()
    for _ in range(loads):
        t0 = time.perf_counter()
        tier.load()
        seconds.append(time.perf_counter() - t0)
        time.sleep(0.2)
    stop.set()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    if errors:
        raise errors[0]
    return {"load_s": seconds, "batches_stored_per_s": next(stored) / elapsed}


def measure(root: Path, chunks: int = 19, chunk_mib: int = 8, writers: int = 4, loads: int = 15,
            repeats: int = 2) -> dict[str, Any]:
    """The figures above, measured under ``root`` (a directory on the disk in question)."""
    try:
        import vllm.v1.kv_offload.tiering.fs.thread_pool  # noqa: F401
        kinds: list[type[_Tierstore] | type[_Fs]] = [_Tierstore, _Fs]
    except ImportError:
        kinds = [_Tierstore]
    rows = _Rows(chunks, chunk_mib << 20, writers)
    runs: dict[str, list[dict[str, Any]]] = {}
    for rep in range(repeats):
        for kind in kinds if rep % 2 == 0 else kinds[::-1]:
            where = root / f"{kind.name}-{rep}"
            tier = kind(where, rows)
            try:
                for label, n in (("alone", 0), ("under_writes", writers)):
                    rows.rows[:chunks].zero_()
                    runs.setdefault(f"{kind.name}_{label}", []).append(_loads_under_writes(tier, n, loads))
                    if not rows.loaded_equal_source():
                        raise RuntimeError(f"{kind.name}: loaded bytes differ from the stored ones")
            finally:
                tier.close()
                shutil.rmtree(where, ignore_errors=True)
    res: dict[str, Any] = {"chunks": chunks, "chunk_mib": chunk_mib, "writers": writers, "loads": loads,
                           "repeats": repeats}
    for name, results in runs.items():
        every = [s for r in results for s in r["load_s"]]
        res[name] = {"load_p50_s": statistics.median(every), "load_max_s": max(every),
                     "batches_stored_per_s": statistics.median(r["batches_stored_per_s"] for r in results)}
    if "fs_under_writes" in res:
        res["tierstore_vs_fs_under_writes"] = (res["tierstore_under_writes"]["load_p50_s"]
                                               / res["fs_under_writes"]["load_p50_s"])
    return res


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="tierstore-bench-mount-", dir=args.dir) as d:
        r = measure(Path(d), args.chunks, args.chunk_mib, args.writers, args.loads, args.repeats)
    print(f"a load of {r['chunks']} x {r['chunk_mib']} MiB into page-aligned memory, {r['writers']} threads storing "
          f"batches of {r['chunks']} meanwhile; medians of {r['loads'] * r['repeats']} loads")
    for name in ("tierstore", "fs"):
        for label in ("alone", "under_writes"):
            row = r.get(f"{name}_{label}")
            if row is not None:
                print(f"{name:<10} {label.replace('_', ' '):<13} load P50 {row['load_p50_s'] * 1e3:7.1f} ms  "
                      f"max {row['load_max_s'] * 1e3:7.1f} ms  batches stored {row['batches_stored_per_s']:5.2f}/s")
    if "tierstore_vs_fs_under_writes" in r:
        print(f"tierstore / fs, load under writes: {r['tierstore_vs_fs_under_writes']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0
