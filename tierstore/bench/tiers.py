"""``tierstore bench tiers``: write/read throughput of each tier's storage backend next to the plain
operation on the same bytes (``torch.clone`` / memcpy, plain file write + read, plain s3fs put + get), plus the
store-level figures: host-hit ``get`` vs ``clone``, ``lookup`` cost per key, write-back ``put`` vs a disk write.

A tier is a backend (plain storage: :mod:`tierstore.backends`) under the store's control plane; the rows
named ``... backend ...`` time the backend alone (its data plane: what the old tier classes' put/get did,
without the index, LRU and capacity bookkeeping, which the store does now once for every tier).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch

from ..backends.base import Backend, Hit
from ..cliargs import nonneg_int, positive_int, progress_printer, size
from ..keys import ChunkKey
from ..store import open_tiered
from .common import Report, gbps, median_time


def add_arguments(p) -> None:
    p.add_argument("--chunk", type=size(1), default="4MiB", help="chunk size (default 4MiB)")
    p.add_argument("--count", type=positive_int, default=64, help="chunks per measurement (default 64)")
    p.add_argument("--total", type=size(1), default=None,
                   help="bytes per measurement instead of --count (e.g. 1GiB: count = total // chunk)")
    p.add_argument("--io-threads", type=positive_int, default=4, help="disk backend io_threads (default 4)")
    p.add_argument("--repeats", type=positive_int, default=5, help="repeats; medians are reported (default 5)")
    p.add_argument("--no-s3", action="store_true", help="skip the local S3 server rows")
    p.add_argument("--shim-chunks", type=nonneg_int, default=64,
                   help="chunks of the cold-instance rows behind the S3 latency shim (0 to skip; default 64)")
    p.add_argument("--shim-chunk", type=size(1), default="1MiB",
                   help="chunk size of the cold-instance rows (default 1MiB)")
    p.add_argument("--shim-in-flight", type=positive_int, default=32,
                   help="remote backend max_in_flight in the shim rows (default 32)")
    p.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    p.add_argument("--lookup-keys", type=positive_int, default=10_000,
                   help="keys in the lookup measurement (default 10,000)")
    p.add_argument("--json", default=None, help="also write the results as JSON here")


def _chunks(count: int, size: int) -> list[tuple[ChunkKey, dict]]:
    g = torch.Generator().manual_seed(0)
    n = size // 8
    return [(ChunkKey.from_bytes(f"bench-{i}".encode()),
             {"k": torch.randn(n, generator=g), "v": torch.randn(n, generator=g)}) for i in range(count)]


def _hits(results: list[Any]) -> None:
    """Raise unless every item of a backend's batched read is a :class:`~tierstore.backends.Hit`."""
    for r in results:
        if isinstance(r, BaseException):
            raise r
        if not isinstance(r, Hit):
            raise RuntimeError("a backend missed an object it holds")


def _stored(results: list[BaseException | None]) -> None:
    """Raise the first failure of a backend's batched write or delete."""
    for r in results:
        if r is not None:
            raise r


def _tier_rows(report: Report, name: str, backend: Backend, items, total: int, repeats: int, put_base, get_base,
               many_base=None) -> None:
    """The backend's data plane, one key per call and batched: ``write`` / ``read`` / ``read_into_many``
    of one key / ``read_into_many`` of all / ``write_many`` (``prepare`` included, as a put encodes)."""
    keys = [k for k, _ in items]

    def put_all():
        for k, v in items:
            backend.write(k, v)

    def clear():
        _stored(backend.delete_many(keys))
        os.sync()

    def get_all():
        for k in keys:
            if backend.read(k) is None:
                raise RuntimeError(f"{name} missed an object it holds")

    t_put = median_time(put_all, repeats, setup=clear)
    put_all()
    t_get = median_time(get_all, repeats, setup=os.sync)
    outs = [{n: torch.empty_like(t) for n, t in v.items()} for _, v in items]

    def get_into_each():
        for k, o in zip(keys, outs, strict=True):
            _hits(backend.read_into_many([k], [o]))

    t_into = median_time(get_into_each, repeats, setup=os.sync)
    report.add(f"{name} write", gbps(total, t_put), "GB/s", put_base)
    report.add(f"{name} read", gbps(total, t_get), "GB/s", get_base)
    report.add(f"{name} read_into, one key per call", gbps(total, t_into), "GB/s", get_base)
    t_many = median_time(lambda: _hits(backend.read_into_many(keys, outs)), repeats, setup=os.sync)
    report.add(f"{name} read_into_many", gbps(total, t_many), "GB/s", many_base or get_base)
    t_put_many = median_time(lambda: _stored(backend.write_many([(k, backend.prepare(k, v)) for k, v in items])),
                             repeats, setup=clear)
    report.add(f"{name} write_many (prepare + write)", gbps(total, t_put_many), "GB/s", put_base)
    clear()


def run(args) -> int:
    from ..backends.file import FileBackend
    from ..backends.memory import HostBackend
    from ..sizes import format_size, parse_size

    size = parse_size(args.chunk)
    if args.total:
        args.count = max(1, parse_size(args.total, key="--total") // size)
    items = _chunks(args.count, size)
    total = sum(v["k"].nbytes + v["v"].nbytes for _, v in items)
    r = args.repeats
    report = Report(f"tierstore bench tiers: {args.count} x {format_size(size)} chunks, median of {r}",
                    meta={"chunk_bytes": size, "count": args.count, "repeats": r, "cpus": os.cpu_count()})

    steps = 5 if args.no_s3 else 6
    progress = progress_printer("bench tiers", " sections")  # a bar on a terminal, lines otherwise
    # physical references: fresh-memory clone and memcpy into an existing buffer
    src = [v for _, v in items]
    clone = report.add("torch.clone (fresh memory)", gbps(total, median_time(
        lambda: [{n: t.clone() for n, t in v.items()} for v in src], r)), "GB/s")
    dst = [{n: torch.empty_like(t) for n, t in v.items()} for v in src]
    memcpy = report.add("memcpy into existing buffers", gbps(total, median_time(
        lambda: [[d[n].copy_(t) for n, t in v.items()] for v, d in zip(src, dst, strict=True)], r)), "GB/s")

    progress(1, steps)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        with HostBackend(capacity=2 * total + (64 << 20), pinned=False) as host:
            _tier_rows(report, "host backend", host, items, total, r, clone, clone, memcpy)
        progress(2, steps)

        files = [os.path.join(tmp, f"plain{i}") for i in range(len(items))]
        payloads = [torch.cat([v["k"], v["v"]]).numpy().data.cast("B") for _, v in items]

        def plain_write():
            for path, data in zip(files, payloads, strict=True):
                with open(path, "wb") as f:
                    f.write(data)

        # a torch buffer, as the backend uses: on this VM a bytearray target reads 4-5x slower (page mapping)
        buf = torch.empty(size, dtype=torch.uint8).numpy().data

        def plain_read():
            for path in files:
                with open(path, "rb", buffering=0) as f:
                    f.readinto(buf)

        def remove_plain():
            for path in files:
                if os.path.exists(path):
                    os.unlink(path)
            os.sync()

        # Like the backend, write new files (not truncate old ones) and start each phase with clean pages.
        pw = report.add("plain file write (no fsync)", gbps(total, median_time(plain_write, r, setup=remove_plain)),
                        "GB/s")
        plain_write()
        pr = report.add("plain file readinto (page cache)", gbps(total, median_time(plain_read, r, setup=os.sync)),
                        "GB/s")
        progress(3, steps)
        with FileBackend(path=os.path.join(tmp, "disk"), io_threads=args.io_threads) as disk:
            _tier_rows(report, "disk backend", disk, items, total, r, pw, pr)
        progress(4, steps)
        if not args.no_s3:
            _s3_rows(report, items, payloads, total, r, args.shim_chunks, parse_size(args.shim_chunk),
                     args.shim_in_flight)
            progress(5, steps)
        _store_rows(report, tmp, items, total, r, clone, args.lookup_keys)
        progress(steps, steps)

    print(report.table())
    if args.json:
        report.write_json(args.json)
    return 0


def _s3_rows(report: Report, items, payloads, total: int, r: int, shim_chunks: int = 0, shim_chunk: int = 1 << 20,
             in_flight: int = 32) -> None:
    from ..backends.fsspec import FsspecBackend
    from ..testing.s3 import local_s3

    with local_s3() as s3:
        bucket = s3.new_bucket()
        fs = s3.filesystem()
        paths = [f"{bucket}/plain/{i}" for i in range(len(items))]
        reps = max(1, r // 2)
        pw = report.add("plain s3fs pipe_file (sequential)", gbps(total, median_time(
            lambda: [fs.pipe_file(p, bytes(d)) for p, d in zip(paths, payloads, strict=True)], reps)), "GB/s")
        pr = report.add("plain s3fs cat_file (sequential)", gbps(total, median_time(
            lambda: [fs.cat_file(p) for p in paths], reps)), "GB/s")
        keys = [k for k, _ in items]
        with FsspecBackend(url=f"s3://{bucket}/tier", storage_options=s3.storage_options) as remote:
            t_put = median_time(lambda: _stored(remote.write_many([(k, remote.prepare(k, v)) for k, v in items])), 1)
            t_get = median_time(lambda: _hits(remote.read_many(keys)), reps)
        report.add("remote backend (S3) write_many", gbps(total, t_put), "GB/s", pw)
        report.add("remote backend (S3) read_many", gbps(total, t_get), "GB/s", pr)
        if shim_chunks:
            _shim_rows(report, s3, shim_chunks, shim_chunk, in_flight, reps)


def _shim_rows(report: Report, s3, count: int, size: int, in_flight: int, repeats: int) -> None:
    """A cold instance (empty local tiers, remote not listed) finds and loads a prefix only S3 holds,
    behind the latency/bandwidth shim, beside the shim's HEAD and GET ceilings at the same concurrency
    (:mod:`tierstore.bench.cold`)."""
    from . import cold

    c = cold.measure(s3, count, size, in_flight, repeats=repeats)

    def row(name: str, key: str, baseline=None, note: str = ""):
        m = c[key]
        requests = " + ".join(f"{n} {method}" for method, n in sorted(m["requests"].items()))
        return report.add(name, m["s"] * 1e3, "ms", baseline, higher_is_better=False,
                          note=f"{requests}{'; ' + note if note else ''}")

    heads = row(f"ceiling: {count} plain HEADs, {in_flight} in flight", "head_ceiling")
    gets = row(f"ceiling: {count} plain GETs, {in_flight} in flight", "get_ceiling")
    row(f"cold lookup, {count} keys", "lookup", heads,
        f"{c['lookup_spaced']['round_trips']} round trips; target <= 100 ms, <= 3 round trips")
    row(f"cold lookup, {count} keys, first after open", "first_lookup", heads, "client start-up included")
    row(f"cold load, {count} chunks, get_many", "load", gets,
        f"{c['load_spaced']['round_trips']} round trips; target <= 500 ms")
    row(f"cold lookup + get_many, {count} chunks", "lookup_load")
    row(f"open (list_on_open) + lookup, {count} keys", "listed")


def _store_rows(report: Report, tmp: str, items, total: int, r: int, clone, n_lookup: int) -> None:
    per_chunk = total / len(items)
    cfg = {"tiers": [{"kind": "host", "capacity": 2 * total + (64 << 20), "pinned": False},
                     {"kind": "disk", "path": os.path.join(tmp, "store-disk"), "capacity": 4 * total}]}
    with open_tiered(cfg) as store:
        t_put = median_time(lambda: [store.put(k, v) for k, v in items], r)
        store.flush()
        t_get = median_time(lambda: [store.get(k) for k, _ in items], r)
        clone_t = total / clone.value / 1e9
        report.add("store.get host hit vs clone", clone_t / t_get, "x clone", note="target >= 0.5")
        # what a put costs when it waits for the disk: the disk tier's backend writing the same objects
        # (the same bytes under the same keys it holds already, so the store's index stays true)
        disk = store.tier("disk").backend

        def disk_writes():
            for k, v in items:
                disk.write(k, v)

        t_disk = median_time(disk_writes, r)
        report.add("store.put write_back per chunk", t_put / len(items) * 1e3, "ms")
        report.add("disk backend write per chunk", t_disk / len(items) * 1e3, "ms")
        report.add("write_back put speed-up vs disk backend write", t_disk / t_put, "x",
                   note=f"{per_chunk / 2**20:.0f} MiB chunks")

    keys = [ChunkKey.from_bytes(f"lookup-{i}".encode()) for i in range(n_lookup)]
    small = {"x": torch.zeros(16)}
    tiers = [{"kind": "host", "capacity": "64MiB", "pinned": False, "pool": False},
             {"kind": "disk", "path": os.path.join(tmp, "lookup-disk"), "capacity": "1GiB"}]
    with open_tiered({"tiers": tiers}) as store:
        for k in keys:
            store.put(k, small)
        store.flush()
        assert store.lookup(keys) == len(keys)
        t = median_time(lambda: store.lookup(keys), r)
        report.add(f"lookup over {n_lookup:,} keys", t / len(keys) * 1e6, "us/key", note="target <= 5")
