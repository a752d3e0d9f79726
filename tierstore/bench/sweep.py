"""Throughput per object size of each tier beside its physical limit measured in the same run, and the
remote tier through the S3 shim beside the shim's concurrent ceiling.

* host tier ``get(out=)`` vs a bare ``copy_`` of the same bytes into existing buffers (memcpy; torch
  runs one intra-op thread in this section, for the tier and its limit alike);
* disk tier ``get(out=)`` vs ``readinto`` of plain files from the page cache, ``put`` vs plain writes
  without fsync (the tier is not durable here either) of the same objects into the same fan-out of folders
  on as many threads as the tier writes with: creating a file costs 18 µs to 1 ms of kernel time on ext4
  depending on the folder, so a limit written elsewhere or on one thread compares placements, not code;
* remote tier ``get`` of ``count`` objects through :mod:`tierstore.bench.s3shim` vs the same objects
  fetched by ``concurrency`` plain threads with one GET each (the ceiling at the configured concurrency),
  the remote backend's own ``read_many`` (fresh tensors; kept under ``tier_get_many``), the per-key
  loop, and a cold instance's ``lookup`` and load of a prefix only S3 holds
  (:mod:`tierstore.bench.cold`, beside the shim's HEAD and GET ceilings at its concurrency).

Reads go through a one-tier store with :mod:`tierstore.bench.ops` (batched where the store has it).
Values are GB/s, median of ``repeats``; a tier and its limit are timed in alternation.
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ..backends.layout import object_relpath
from ..keys import ChunkKey
from ..store import open_tiered
from . import cold
from .common import gbps, median_time
from .ops import delete_all, get_all_into, put_all


def _objects(count: int, size: int, tag: str) -> list[tuple[ChunkKey, dict[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(size)
    return [(ChunkKey.from_bytes(f"sweep-{tag}-{size}-{i}".encode()),
             {"kv": torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)}) for i in range(count)]


def tier_sizes(sizes: list[int], total: int, repeats: int, workdir: str | None = None,
               log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """One row per object size: GB/s of each tier operation and of its limit, ``total`` bytes each."""
    rows = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # copy_ of MiBs splits over threads, which stall on a busy machine; 1 for all
    try:
        for size in sizes:
            count = max(2, total // size)
            log(f"  tiers: {count} x {size >> 10} KiB")
            with tempfile.TemporaryDirectory(prefix="tierstore-bench-sweep-", dir=workdir) as tmp:
                rows.append(_one_size(size, count, repeats, tmp))
    finally:
        torch.set_num_threads(threads)
    return rows


def _one_size(size: int, count: int, repeats: int, tmp: str) -> dict[str, Any]:
    items = _objects(count, size, "tiers")
    keys = [k for k, _ in items]
    outs = [{"kv": torch.zeros(size, dtype=torch.uint8)} for _ in items]  # touched: no page faults timed
    files = [os.path.join(tmp, "plain", object_relpath(k)) for k in keys]  # the disk tier's fan-out
    for folder in {os.path.dirname(f) for f in files}:
        os.makedirs(folder, exist_ok=True)

    def write_one(i: int) -> None:
        with open(files[i], "wb") as f:
            f.write(items[i][1]["kv"].numpy().data)

    def plain_write() -> None:
        list(writers.map(write_one, range(count)))

    def remove_plain() -> None:
        for path in files:
            if os.path.exists(path):
                os.unlink(path)

    def plain_read() -> None:
        for path, o in zip(files, outs, strict=True):
            with open(path, "rb", buffering=0) as f:
                f.readinto(o["kv"].numpy().data)

    host_cfg = {"tiers": [{"kind": "host", "capacity": 2 * count * size + (64 << 20), "pinned": False}]}
    disk_cfg = {"tiers": [{"kind": "disk", "path": os.path.join(tmp, "disk"), "capacity": 3 * count * size}]}
    with open_tiered(host_cfg) as host, open_tiered(disk_cfg) as disk, \
            ThreadPoolExecutor(getattr(disk.tier("disk").backend, "io_threads", 4)) as writers:
        cases: dict[str, Case] = {  # in this order; each get follows the put that stored its objects
            "memcpy": (lambda: [o["kv"].copy_(v["kv"]) for o, (_, v) in zip(outs, items, strict=True)], None),
            "host_put": (lambda: put_all(host, items), lambda: delete_all(host, keys)),
            "host_get": (lambda: _checked(get_all_into(host, keys, outs)), None),
            "plain_write": (plain_write, remove_plain),
            "page_cache_read": (plain_read, None),
            "disk_put": (lambda: put_all(disk, items), lambda: delete_all(disk, keys)),
            "disk_get": (lambda: _checked(get_all_into(disk, keys, outs)), None),
        }
        return {"size": size, "count": count, **interleaved(cases, count * size, repeats)}


Case = tuple[Callable[[], object], Callable[[], object] | None]


def interleaved(cases: dict[str, Case], nbytes: int, repeats: int) -> dict[str, float]:
    """GB/s of each ``(fn, setup)`` case, median of ``repeats``: each repeat runs every case once in turn
    (after one untimed warm-up round), so a disturbance on a shared machine hits a tier and its limit
    alike instead of one of them only."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for r in range(repeats + 1):
        for name, (fn, setup) in cases.items():
            if setup is not None:
                setup()
            t0 = time.perf_counter()
            fn()
            if r:
                times[name].append(time.perf_counter() - t0)
    return {name: gbps(nbytes, statistics.median(ts)) for name, ts in times.items()}


def _rate(fn: Callable[[], object], nbytes: int, repeats: int, setup: Callable[[], object] | None = None) -> float:
    """GB/s: median of ``repeats`` timed runs after one untimed warm-up (thread pools, page faults)."""
    if setup is not None:
        setup()
    fn()
    return gbps(nbytes, median_time(fn, repeats, setup))


def _checked(results: list[Any]) -> None:
    """Raise unless every result is a hit (a store's tensors, or a backend's :class:`Hit`)."""
    for r in results:
        if isinstance(r, BaseException):
            raise r
        if r is None:
            raise RuntimeError("a tier missed an object it holds")


def remote(count: int, size: int, concurrency: int = 8, latency: float = 0.020, bandwidth: float = 90e6,
           repeats: int = 3, log: Callable[[str], None] = print, cold_count: int = 64, cold_size: int = 1 << 20,
           cold_in_flight: int = 32) -> dict[str, Any]:
    """The remote tier through the S3 shim: ``get`` of ``count`` objects vs the concurrent ceiling, and a
    cold instance's lookup and load of ``cold_count`` chunks (:mod:`tierstore.bench.cold`, under ``cold``)."""

    from ..testing.s3 import local_s3
    from .s3shim import S3Shim

    items = _objects(count, size, "remote")
    keys = [k for k, _ in items]
    nbytes = count * size
    outs = [{"kv": torch.zeros(size, dtype=torch.uint8)} for _ in items]
    waves = math.ceil(count / concurrency)
    res: dict[str, Any] = {"count": count, "size": size, "concurrency": concurrency, "latency_s": latency,
                           "bandwidth_Bps": bandwidth,
                           "model_ceiling": nbytes / (waves * (latency + size / bandwidth)) / 1e9}
    with local_s3() as s3:
        with S3Shim(s3.endpoint_url, latency, bandwidth) as shim:
            bucket = s3.new_bucket("bench")
            opts = shim.storage_options(s3.storage_options)
            import s3fs

            fs = s3fs.S3FileSystem(**opts)
            raw = [f"{bucket}/raw/{i}" for i in range(count)]
            log(f"  remote: uploading {count} x {size >> 10} KiB through the shim")
            for path, (_, v) in zip(raw, items, strict=True):
                fs.pipe_file(path, v["kv"].numpy().tobytes())

            def one_get(path: str) -> bytes:
                data: bytes = fs.cat_file(path, max_concurrency=1)  # a single GET, as the tier sends
                return data

            with ThreadPoolExecutor(concurrency) as pool:
                res["ceiling"] = _rate(lambda: list(pool.map(one_get, raw)), nbytes, repeats)
            res["single_stream"] = gbps(nbytes, median_time(lambda: [one_get(p) for p in raw], 1))
            cfg = {"tiers": [{"kind": "remote", "url": f"s3://{bucket}/tier", "storage_options": opts,
                              "max_in_flight": concurrency}]}
            log("  remote: tier put and get")
            with open_tiered(cfg) as store:
                t0 = time.perf_counter()
                put_all(store, items)
                res["put"] = gbps(nbytes, time.perf_counter() - t0)
                res["get"] = _rate(lambda: _checked(get_all_into(store, keys, outs)), nbytes, repeats)
                # the tier's storage alone (what the remote tier's own get_many was): its backend's read_many
                backend = store.tier("remote").backend
                res["tier_get_many"] = _rate(lambda: _checked(backend.read_many(keys)), nbytes, repeats)
                res["get_loop"] = gbps(nbytes, median_time(
                    lambda: _checked([store.get(k, out=o) for k, o in zip(keys, outs, strict=True)]), 1))
            if not all(torch.equal(o["kv"], v["kv"]) for o, (_, v) in zip(outs, items, strict=True)):
                raise RuntimeError("remote tier returned wrong bytes")
        res["cold"] = cold.measure(s3, cold_count, cold_size, cold_in_flight, latency, bandwidth, repeats, log)
    return res
