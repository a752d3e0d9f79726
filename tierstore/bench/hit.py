"""``tierstore bench hit``: what one host-tier hit costs the caller, and what the per-read job bookkeeping adds.

A host-only store holds one chunk; ``get_many([key], out=buffers)`` is timed in blocks of ``calls``, and the
blocks alternate between the job bookkeeping as it is (a transfer run on the caller's thread is listed while
it runs, no future) and as it was (each read a job with its own ``Future``, resolved when the read ends).
Medians and minimums per call of ``blocks`` blocks each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", type=int, default=4096, help="bytes per chunk (default 4096)")
    p.add_argument("--calls", type=int, default=2000, help="calls per block (default 2000)")
    p.add_argument("--blocks", type=int, default=30, help="blocks, alternating (default 30)")
    p.add_argument("--json", default=None, help="also write the results as JSON here")


def _run_with_future(self: Any, kind: str, tier: str, keys: int, fn: Callable[[], T]) -> T:
    """``Jobs.run`` as it was: a job with its own future, resolved when ``fn`` returns."""
    from ..transfers import Job

    future: Future[T] = Future()
    job = Job(next(self._ids), kind, tier, keys, future)
    with self._lock:
        self._running[job.id] = job
    try:
        result = fn()
    except BaseException as exc:
        with self._lock:
            del self._running[job.id]
            self.done += 1
        future.set_exception(exc)
        raise
    with self._lock:
        del self._running[job.id]
        self.done += 1
    future.set_result(result)
    return result


def measure(size: int = 4096, calls: int = 2000, blocks: int = 30) -> dict[str, Any]:
    import torch

    import tierstore

    from ..testing.data import chunk, key_of
    from ..transfers import Jobs

    now = Jobs.run
    us: dict[str, list[float]] = {"now": [], "with_future": []}
    with tierstore.open({"tiers": [{"kind": "host", "capacity": "64MiB", "pinned": False}]}) as s:
        key, value = key_of(1), chunk(1, size)
        s.put(key, value)
        out = [{n: torch.empty_like(t) for n, t in value.items()}]
        for _ in range(calls):
            s.get_many([key], out=out)
        try:
            for b in range(blocks):
                order = (("now", now), ("with_future", _run_with_future))
                for name, run in order if b % 2 else order[::-1]:
                    Jobs.run = run  # type: ignore[method-assign]
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        s.get_many([key], out=out)
                    us[name].append((time.perf_counter() - t0) / calls * 1e6)
        finally:
            Jobs.run = now  # type: ignore[method-assign]
    res: dict[str, Any] = {"size": size, "calls": calls, "blocks": blocks}
    for name, values in us.items():
        res[name] = {"median_us": statistics.median(values), "min_us": min(values)}
    res["now_vs_with_future"] = res["now"]["median_us"] / res["with_future"]["median_us"]
    return res


def run(args: argparse.Namespace) -> int:
    r = measure(args.size, args.calls, args.blocks)
    print(f"one-key host hit, get_many([k], out=), {r['size']} B, {r['blocks']} alternated blocks of {r['calls']}")
    for name, label in (("now", "jobs as now (no future for a read)"), ("with_future", "a Future per read (before)")):
        print(f"{label:<40} median {r[name]['median_us']:6.1f} us   min {r[name]['min_us']:6.1f} us")
    print(f"now / before             {r['now_vs_with_future']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0
