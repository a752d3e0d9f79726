"""``tierstore bench tiers``: put/get throughput of each tier next to the plain operation on the same
bytes (``torch.clone`` / memcpy, plain file write + read, plain s3fs put + get), plus the store-level
figures: host-hit ``get`` vs ``clone``, ``lookup`` cost per key, write-back ``put`` vs a disk put.
"""

from __future__ import annotations

import os
import tempfile

import torch

from ..keys import ChunkKey
from .common import Report, gbps, median_time


def add_arguments(p) -> None:
    p.add_argument("--chunk", default="4MiB", help="chunk size (default 4MiB)")
    p.add_argument("--count", type=int, default=64, help="chunks per measurement (default 64)")
    p.add_argument("--total", default=None,
                   help="bytes per measurement instead of --count (e.g. 1GiB: count = total // chunk)")
    p.add_argument("--io-threads", type=int, default=4, help="disk tier io_threads (default 4)")
    p.add_argument("--repeats", type=int, default=5, help="repeats; medians are reported (default 5)")
    p.add_argument("--no-s3", action="store_true", help="skip the local S3 server rows")
    p.add_argument("--shim-chunks", type=int, default=64,
                   help="chunks of the cold-instance rows behind the S3 latency shim (0 to skip; default 64)")
    p.add_argument("--shim-chunk", default="1MiB", help="chunk size of the cold-instance rows (default 1MiB)")
    p.add_argument("--shim-in-flight", type=int, default=32,
                   help="remote tier max_in_flight in the shim rows (default 32)")
    p.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    p.add_argument("--lookup-keys", type=int, default=10_000, help="keys in the lookup measurement (default 10,000)")
    p.add_argument("--json", default=None, help="also write the results as JSON here")


def _chunks(count: int, size: int) -> list[tuple[ChunkKey, dict]]:
    g = torch.Generator().manual_seed(0)
    n = size // 8
    return [(ChunkKey.from_bytes(f"bench-{i}".encode()),
             {"k": torch.randn(n, generator=g), "v": torch.randn(n, generator=g)}) for i in range(count)]


def _tier_rows(report: Report, name: str, tier, items, total: int, repeats: int, put_base, get_base,
               many_base=None) -> None:
    def put_all():
        for k, v in items:
            tier.put(k, v)

    def clear():
        tier.delete_many([k for k, _ in items])
        os.sync()

    t_put = median_time(put_all, repeats, setup=clear)
    put_all()
    t_get = median_time(lambda: [tier.get(k) for k, _ in items], repeats, setup=os.sync)
    outs = [{n: torch.empty_like(t) for n, t in v.items()} for _, v in items]
    t_into = median_time(lambda: [tier.get(k, out=o) for (k, _), o in zip(items, outs, strict=True)], repeats,
                         setup=os.sync)
    report.add(f"{name} put", gbps(total, t_put), "GB/s", put_base)
    report.add(f"{name} get", gbps(total, t_get), "GB/s", get_base)
    report.add(f"{name} get(out=)", gbps(total, t_into), "GB/s", get_base)
    keys = [k for k, _ in items]
    t_many = median_time(lambda: tier.get_many_into(keys, outs), repeats, setup=os.sync)
    report.add(f"{name} get_many(out=)", gbps(total, t_many), "GB/s", many_base or get_base)
    t_put_many = median_time(lambda: tier.put_many(items), repeats, setup=clear)
    report.add(f"{name} put_many", gbps(total, t_put_many), "GB/s", put_base)
    clear()


def run(args) -> int:
    from ..sizes import parse_size
    from ..tiers.disk import DiskTier
    from ..tiers.host import HostTier

    size = parse_size(args.chunk)
    if args.total:
        args.count = max(1, parse_size(args.total, key="--total") // size)
    items = _chunks(args.count, size)
    total = sum(v["k"].nbytes + v["v"].nbytes for _, v in items)
    r = args.repeats
    report = Report(f"tierstore bench tiers: {args.count} x {args.chunk} chunks, median of {r}",
                    meta={"chunk_bytes": size, "count": args.count, "repeats": r, "cpus": os.cpu_count()})

    # physical references: fresh-memory clone and memcpy into an existing buffer
    src = [v for _, v in items]
    clone = report.add("torch.clone (fresh memory)", gbps(total, median_time(
        lambda: [{n: t.clone() for n, t in v.items()} for v in src], r)), "GB/s")
    dst = [{n: torch.empty_like(t) for n, t in v.items()} for v in src]
    memcpy = report.add("memcpy into existing buffers", gbps(total, median_time(
        lambda: [[d[n].copy_(t) for n, t in v.items()] for v, d in zip(src, dst, strict=True)], r)), "GB/s")

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        host = HostTier(capacity=2 * total + (64 << 20), pinned=False)
        _tier_rows(report, "host tier", host, items, total, r, clone, clone, memcpy)
        host.close()

        files = [os.path.join(tmp, f"plain{i}") for i in range(len(items))]
        payloads = [torch.cat([v["k"], v["v"]]).numpy().data.cast("B") for _, v in items]

        def plain_write():
            for path, data in zip(files, payloads, strict=True):
                with open(path, "wb") as f:
                    f.write(data)

        # a torch buffer, as the tier uses: on this VM a bytearray target reads 4-5x slower (page mapping)
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

        # Like the tier, write new files (not truncate old ones) and start each phase with clean pages.
        pw = report.add("plain file write (no fsync)", gbps(total, median_time(plain_write, r, setup=remove_plain)),
                        "GB/s")
        plain_write()
        pr = report.add("plain file readinto (page cache)", gbps(total, median_time(plain_read, r, setup=os.sync)),
                        "GB/s")
        disk = DiskTier(path=os.path.join(tmp, "disk"), capacity=4 * total, io_threads=args.io_threads)
        _tier_rows(report, "disk tier", disk, items, total, r, pw, pr)
        disk.close()

        if not args.no_s3:
            _s3_rows(report, items, payloads, total, r, args.shim_chunks, parse_size(args.shim_chunk),
                     args.shim_in_flight)
        _store_rows(report, tmp, items, total, r, clone, args.lookup_keys)

    print(report.table())
    if args.json:
        report.write_json(args.json)
    return 0


def _s3_rows(report: Report, items, payloads, total: int, r: int, shim_chunks: int = 0, shim_chunk: int = 1 << 20,
             in_flight: int = 32) -> None:
    from ..testing.s3 import local_s3
    from ..tiers.remote import RemoteTier

    with local_s3() as s3:
        bucket = s3.new_bucket()
        fs = s3.filesystem()
        paths = [f"{bucket}/plain/{i}" for i in range(len(items))]
        reps = max(1, r // 2)
        pw = report.add("plain s3fs pipe_file (sequential)", gbps(total, median_time(
            lambda: [fs.pipe_file(p, bytes(d)) for p, d in zip(paths, payloads, strict=True)], reps)), "GB/s")
        pr = report.add("plain s3fs cat_file (sequential)", gbps(total, median_time(
            lambda: [fs.cat_file(p) for p in paths], reps)), "GB/s")
        remote = RemoteTier(url=f"s3://{bucket}/tier", storage_options=s3.storage_options)
        keys = [k for k, _ in items]
        t_put = median_time(lambda: remote.put_many(items), 1)
        t_get = median_time(lambda: remote.get_many(keys), reps)
        report.add("remote tier (S3) put_many", gbps(total, t_put), "GB/s", pw)
        report.add("remote tier (S3) get_many", gbps(total, t_get), "GB/s", pr)
        remote.close()
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
    import tierstore

    per_chunk = total / len(items)
    cfg = {"tiers": [{"kind": "host", "capacity": 2 * total + (64 << 20), "pinned": False},
                     {"kind": "disk", "path": os.path.join(tmp, "store-disk"), "capacity": 4 * total}]}
    with tierstore.open(cfg) as store:
        t_put = median_time(lambda: [store.put(k, v) for k, v in items], r)
        store.flush()
        t_get = median_time(lambda: [store.get(k) for k, _ in items], r)
        clone_t = total / clone.value / 1e9
        report.add("store.get host hit vs clone", clone_t / t_get, "x clone", note="target >= 0.5")
        disk = store.tier("disk")
        t_disk = median_time(lambda: [disk.put(k, v) for k, v in items], r)
        report.add("store.put write_back per chunk", t_put / len(items) * 1e3, "ms")
        report.add("disk tier put per chunk", t_disk / len(items) * 1e3, "ms")
        report.add("write_back put speed-up vs disk put", t_disk / t_put, "x",
                   note=f"{per_chunk / 2**20:.0f} MiB chunks")

    keys = [ChunkKey.from_bytes(f"lookup-{i}".encode()) for i in range(n_lookup)]
    small = {"x": torch.zeros(16)}
    tiers = [{"kind": "host", "capacity": "64MiB", "pinned": False, "pool": False},
             {"kind": "disk", "path": os.path.join(tmp, "lookup-disk"), "capacity": "1GiB"}]
    with tierstore.open({"tiers": tiers}) as store:
        for k in keys:
            store.put(k, small)
        store.flush()
        assert store.lookup(keys) == len(keys)
        t = median_time(lambda: store.lookup(keys), r)
        report.add(f"lookup over {n_lookup:,} keys", t / len(keys) * 1e6, "us/key", note="target <= 5")
