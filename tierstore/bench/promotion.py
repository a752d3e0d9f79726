"""``tierstore bench promotion``: what promotion and write-back cost a reader, through the S3 shim.

Another engine published ``count`` chunks of ``size`` bytes to S3. For each repeat, in turn, a fresh store
(host + disk + the remote behind the shim, its client started) reads all of them with one ``get_many``:

* ``transient``: nothing is promoted (the reference);
* ``retain``: the chunks are promoted to the host tier by a background job once ``get_many`` has returned
  them (the objects it read are handed to the job: no second GET), the disk filled by write-back
  (targets: ``retain / transient <= 1.3``);
* ``retain_with_put``: the same while another thread puts one other chunk (an engine saves while it loads;
  review #4 measured 756 ms instead of 32-90 ms and every chunk read twice; targets:
  ``retain_with_put / retain <= 1.2``, and one GET per chunk).

GETs are counted at the shim once the store runs no promotion job any more (untimed), so a promotion that
read a chunk again would show.

Then ``writeback``: a disk + remote store writes ``count`` chunks through to S3 by write-back, and the bytes
the shim received in PUT bodies are compared with the objects' bytes on disk (target: equal — the object
moves as it is, no decode and no re-encode). Times are medians of ``repeats``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from ..backends.file import FileBackend
from ..backends.layout import object_relpath
from ..cliargs import nonneg_float, positive_int
from ..keys import ChunkKey
from ..store import open_tiered
from .ops import wait_for_jobs


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--count", type=positive_int, default=32, help="chunks read (default 32)")
    p.add_argument("--size", type=positive_int, default=1 << 20, help="bytes per chunk (default 1 MiB)")
    p.add_argument("--latency", type=nonneg_float, default=0.020,
                   help="seconds the shim adds to each answer (default 0.02)")
    p.add_argument("--repeats", type=positive_int, default=5,
                   help="runs per configuration; medians reported (default 5)")
    p.add_argument("--json", default=None, help="also write the results as JSON here")


def _chunks(tag: str, count: int, size: int, seed: int) -> list[tuple[ChunkKey, dict[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    return [(ChunkKey.from_bytes(f"promotion-{tag}-{i}".encode()),
             {"kv": torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)}) for i in range(count)]


def measure(s3: Any, count: int = 32, size: int = 1 << 20, latency: float = 0.020, repeats: int = 5,
            workdir: str | None = None, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The figures above against the local S3 server ``s3`` (a :class:`tierstore.testing.s3.LocalS3`)."""
    import tierstore

    from ..backends.fsspec import FsspecBackend
    from .s3shim import S3Shim

    items = _chunks("read", count, size, 1)
    keys = [k for k, _ in items]
    url = f"s3://{s3.new_bucket('promotion')}/kv"
    with FsspecBackend(url=url, storage_options=s3.storage_options) as writer:
        if any(writer.write_many([(k, writer.prepare(k, v)) for k, v in items])):
            raise RuntimeError("could not publish the chunks")
    paths = {f"/{url[len('s3://'):]}/{object_relpath(k)}" for k in keys}
    times: dict[str, list[float]] = {"transient": [], "retain": [], "retain_with_put": []}
    gets: dict[str, list[int]] = {name: [] for name in times}
    with tempfile.TemporaryDirectory(dir=workdir) as tmp, S3Shim(s3.endpoint_url, latency, bandwidth=0) as shim:
        options = shim.storage_options(s3.storage_options)

        def store(policy: str, run: int, name: str) -> tierstore.TieredStore:
            cfg = {"tiers": [{"kind": "host", "capacity": 4 * count * size + (64 << 20), "pinned": False},
                             {"kind": "disk", "path": os.path.join(tmp, f"{name}-{run}")},
                             {"kind": "remote", "url": url, "storage_options": options, "list_on_open": False}],
                   "prefetch_policy": policy}
            s = open_tiered(cfg)
            s.contains_many([ChunkKey.from_bytes(b"promotion-warm-up-%d" % i) for i in range(8)])  # client up
            return s

        def read(s: tierstore.TieredStore, name: str) -> None:
            shim.reset()
            t0 = time.perf_counter()
            got = s.get_many(keys)
            times[name].append(time.perf_counter() - t0)
            wait_for_jobs(s)  # the promotions it started: their GETs count too
            per_path = shim.stats()["gets"]
            gets[name].append(sum(per_path.get(p, 0) for p in paths))
            if any(g is None or not torch.equal(g["kv"], v["kv"]) for g, (_, v) in zip(got, items, strict=True)):
                raise RuntimeError(f"{name}: get_many missed or returned wrong bytes")

        others = _chunks("other", repeats, size, 2)
        log(f"  promotion: {count} x {size >> 10} KiB remote chunks, {latency * 1e3:.0f} ms latency, "
            f"{repeats} repeats")
        for run in range(repeats):
            for name in ("transient", "retain", "retain_with_put"):
                with store("transient" if name == "transient" else "retain", run, name) as s:
                    if name != "retain_with_put":
                        read(s, name)
                        continue
                    putter = threading.Timer(0.005, s.put, others[run])  # while get_many reads
                    putter.start()
                    try:
                        read(s, name)
                    finally:
                        putter.join()

        written = _chunks("written", count, size, 3)
        disk_dir = os.path.join(tmp, "writeback-disk")
        remote = {"kind": "remote", "url": f"s3://{s3.new_bucket('writeback')}/kv", "storage_options": options}
        with open_tiered({"tiers": [{"kind": "disk", "path": disk_dir}, remote]}) as s:
            shim.reset()
            s.put_many(written)
            s.flush(timeout=120)
            uploaded = shim.stats()["bytes_in"]
            disk = s.tier("disk").backend
            assert isinstance(disk, FileBackend)
            object_bytes = sum(os.path.getsize(disk.object_path(k)) for k, _ in written)
    res: dict[str, Any] = {"count": count, "size": size, "latency_s": latency, "repeats": repeats}
    for name in times:
        res[name] = {"s": statistics.median(times[name]), "gets": statistics.median(gets[name])}
    res["retain_vs_transient"] = res["retain"]["s"] / res["transient"]["s"]
    res["put_vs_quiet"] = res["retain_with_put"]["s"] / res["retain"]["s"]
    res["writeback"] = {"uploaded_bytes": uploaded, "object_bytes": object_bytes,
                        "ratio": uploaded / object_bytes if object_bytes else 0.0}
    return res


def run(args: argparse.Namespace) -> int:
    from ..testing.s3 import local_s3

    with local_s3() as s3:
        r = measure(s3, args.count, args.size, args.latency, args.repeats)
    ms = {n: r[n]["s"] * 1e3 for n in ("transient", "retain", "retain_with_put")}
    print(f"{'get_many of':<34} {'ms':>8} {'GETs':>6}")
    for name, label in (("transient", "transient (reference)"), ("retain", "retain"),
                        ("retain_with_put", "retain, another thread putting")):
        print(f"{label:<34} {ms[name]:>8.1f} {r[name]['gets']:>6.0f}")
    print(f"retain / transient        {r['retain_vs_transient']:.2f}  (target <= 1.3)")
    print(f"with a put / without      {r['put_vs_quiet']:.2f}  (target <= 1.2, one GET per chunk)")
    wb = r["writeback"]
    print(f"disk -> remote write-back uploaded {wb['uploaded_bytes']:,} bytes for {wb['object_bytes']:,} bytes "
          f"of objects: {wb['ratio']:.3f}  (target 1.000)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0
