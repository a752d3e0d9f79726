"""``tierstore bench writeback``: remote write-back throughput against plain PUTs at the same concurrency.

A host + remote store (the remote: the local S3 server behind the shim, which adds ``latency`` to every
answer, as a distant endpoint does; the tier's ``max_in_flight`` is ``concurrency``) is given ``count``
chunks of ``size`` bytes with write-back held back, then write-back is released and ``flush()`` timed: the
drain. The reference writes the same objects with one batched ``write_many`` of a remote backend with the
same ``max_in_flight`` (``concurrency`` uploads at once, what the tier itself allows, nothing of the store).
A third row reruns the drain scheduled as before this change (batches of the store's ``max_in_flight`` = 8,
one batch in flight per tier). Runs alternate; medians of ``repeats``. Target: drain / reference <= 1.3.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from typing import Any

import torch

from ..keys import ChunkKey


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--count", type=int, default=320, help="chunks written back (default 320)")
    p.add_argument("--size", type=int, default=64 << 10, help="bytes per chunk (default 64 KiB)")
    p.add_argument("--latency", type=float, default=0.050, help="seconds the shim adds to each answer (0.05)")
    p.add_argument("--concurrency", type=int, default=32, help="the remote tier's max_in_flight (default 32)")
    p.add_argument("--repeats", type=int, default=3, help="runs per configuration; medians (default 3)")
    p.add_argument("--json", default=None, help="also write the results as JSON here")


def _chunks(tag: str, count: int, size: int) -> list[tuple[ChunkKey, dict[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(count)
    return [(ChunkKey.from_bytes(f"writeback-{tag}-{i}".encode()),
             {"kv": torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)}) for i in range(count)]


def measure(s3: Any, count: int = 320, size: int = 64 << 10, latency: float = 0.050, concurrency: int = 32,
            repeats: int = 3) -> dict[str, Any]:
    """The figures above against the local S3 server ``s3`` (a :class:`tierstore.testing.s3.LocalS3`)."""
    from ..backends.fsspec import FsspecBackend
    from ..store import open_tiered
    from .s3shim import S3Shim

    times: dict[str, list[float]] = {"reference": [], "writeback": [], "writeback_before": []}
    with S3Shim(s3.endpoint_url, latency, bandwidth=0) as shim:
        options = shim.storage_options(s3.storage_options)

        def reference(run: int) -> None:
            items = _chunks(f"ref{run}", count, size)
            url = f"s3://{s3.new_bucket(f'wb-ref-{run}')}/kv"
            with FsspecBackend(url=url, storage_options=options, max_in_flight=concurrency,
                               list_on_open=False) as backend:
                backend.stat_many([items[0][0]])  # the client is up
                prepared = [(k, backend.prepare(k, v)) for k, v in items]
                t0 = time.perf_counter()
                errors = backend.write_many(prepared)
                times["reference"].append(time.perf_counter() - t0)
            if any(errors):
                raise RuntimeError(f"reference: {sum(1 for e in errors if e)} uploads failed")

        def drain(run: int, name: str) -> None:
            items = _chunks(f"{name}{run}", count, size)
            cfg = {"tiers": [{"kind": "host", "capacity": 2 * count * size + (64 << 20), "pinned": False},
                             {"kind": "remote", "url": f"s3://{s3.new_bucket(f'wb-{name}-{run}'.replace('_', '-'))}/kv",
                              "storage_options": options, "max_in_flight": concurrency, "list_on_open": False}]}
            with open_tiered(cfg) as s:  # the embedded store itself: its write-back is held back below
                wb = s._writeback  # noqa: SLF001 - the bench holds write-back back while it fills the host
                if name == "writeback_before":
                    wb.pipeline, wb._batches = 1, dict.fromkeys(wb._batches, 8)  # noqa: SLF001
                release, due = threading.Event(), wb._due  # noqa: SLF001
                wb._due = lambda: due() if release.is_set() else None  # type: ignore[method-assign]  # noqa: SLF001
                s.contains_many([items[0][0]])  # the client is up
                if not all(s.put_many(items)):
                    raise RuntimeError(f"{name}: a put was refused")
                t0 = time.perf_counter()
                release.set()
                s.residency.notify()
                s.flush(timeout=600)
                times[name].append(time.perf_counter() - t0)

        for run in range(repeats):
            reference(run)
            drain(run, "writeback")
            drain(run, "writeback_before")
    res: dict[str, Any] = {"count": count, "size": size, "latency_s": latency, "concurrency": concurrency,
                           "repeats": repeats}
    for name, values in times.items():
        res[name] = {"s": statistics.median(values), "runs": values}
    res["writeback_vs_reference"] = res["writeback"]["s"] / res["reference"]["s"]
    res["before_vs_reference"] = res["writeback_before"]["s"] / res["reference"]["s"]
    return res


def run(args: argparse.Namespace) -> int:
    from ..testing.s3 import local_s3

    with local_s3() as s3:
        r = measure(s3, args.count, args.size, args.latency, args.concurrency, args.repeats)
    print(f"{r['count']} x {r['size'] >> 10} KiB to S3 behind {r['latency_s'] * 1e3:.0f} ms, "
          f"max_in_flight {r['concurrency']}, medians of {r['repeats']}")
    for name, label in (("reference", f"write_many, {r['concurrency']} PUTs at once (reference)"),
                        ("writeback", "write-back drain (flush)"),
                        ("writeback_before", "write-back, batches of 8, one in flight (as before)")):
        print(f"{label:<56} {r[name]['s']:>7.2f} s")
    print(f"write-back / reference   {r['writeback_vs_reference']:.2f}  (target <= 1.3)")
    print(f"as before / reference    {r['before_vs_reference']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0
