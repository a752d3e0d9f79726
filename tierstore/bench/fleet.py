"""``tierstore bench fleet``: N instances sharing one S3 prefix, with a gc sidecar holding it under budget.

Instances are threads of this process, each with its own store (host tier + the shared remote through the
S3 shim: 20 ms first byte, 90 MB/s per connection) — async clients, not processes: 64 processes with
torch would not fit this machine. The fleet's offered load is fixed (``rate`` requests a second across
all instances, each request at its scheduled time, or at once when its instance is late): what grows with
N is the number of instances, writers and objects sharing the prefix, not the request rate the 2-core
machine's S3 stand-in must serve (closed-loop, 64 instances saturate it: lookup time then measures the
stand-in's queue, ``--rate 0``). Each instance serves ``users`` conversations of ``rounds`` rounds: a
shared system prompt, then each user's own growing history, KV chunks of ``chunk_tokens`` tokens
(content derived from the tokens, so every instance stores the same bytes for the same prefix). Per
request: ``lookup`` (the token hit), ``load`` of what hit, ``save`` of the rest (write-back to the
remote). A gc sidecar runs ``collect_garbage(max_size=budget)`` every ``gc_every`` seconds with a budget
of ``budget_share`` of the working set.

Reported per N: lookup and load time (medians over rounds ≥ 2 — as one instance sees them), the token hit
rate of rounds ≥ 2, loads whose chunks gc removed between lookup and load (a miss: recomputed), gc passes
with their LIST requests and object GETs per pass, and the prefix size vs the budget. No coordinator: the
target is lookup time at 64 ≤ 1.3 × at 8.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from contextlib import closing
from typing import Any

import torch

from ..cliargs import nonneg_float, positive_float, positive_int
from ..store import open_tiered

SYSTEM_TOKENS = 512
TURN_TOKENS = 128
RATE = 8.0  # requests per second, the whole fleet together
#: seconds between refreshes of an object's last use (the tier's 600 s default is for hours-long runs: this
#: one lasts about a minute, and an object unused for a few seconds is already a gc candidate)
TOUCH_AFTER_S = 2.0
#: seconds between gc passes: a pass lists the whole prefix, and on this machine the local S3 server spends
#: CPU per listed object that its other answers then wait for (1 s passes doubled lookup time at 64)
GC_EVERY = 4.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--instances", default="8,16,32,64", help="fleet sizes (default 8,16,32,64)")
    p.add_argument("--users", type=positive_int, default=2, help="conversations per instance (default 2)")
    p.add_argument("--rounds", type=positive_int, default=4, help="rounds per conversation (default 4)")
    p.add_argument("--chunk-tokens", type=positive_int, default=64, help="tokens per KV chunk (default 64)")
    p.add_argument("--budget-share", type=positive_float, default=0.5, help="gc budget as a share of the working set")
    p.add_argument("--latency", type=nonneg_float, default=0.020,
                   help="seconds the shim adds per answer (default 0.02)")
    p.add_argument("--gc-every", type=positive_float, default=GC_EVERY,
                   help=f"seconds between gc passes (default {GC_EVERY:g})")
    p.add_argument("--rate", type=positive_float, default=RATE,
                   help=f"requests per second across the fleet (default {RATE:g}; "
                   "0: every instance as fast as it can)")
    p.add_argument("--json", default=None, help="also write the results as JSON here")


def _layers(tokens: list[int]) -> list[torch.Tensor]:
    """Two layers of (2, n, 2, 16) float16 KV that depend only on the tokens (the same prefix, the same bytes)."""
    t = torch.tensor(tokens, dtype=torch.float16).view(1, -1, 1, 1)
    return [(t + layer).expand(2, -1, 2, 16).contiguous() for layer in range(2)]


def one_fleet(s3: Any, n: int, users: int = 2, rounds: int = 4, chunk_tokens: int = 64, budget_share: float = 0.5,
              latency: float = 0.020, gc_every: float = GC_EVERY, rate: float = RATE) -> dict[str, Any]:
    from tierstore.errors import MissingKeyError
    from tierstore.kv import KVCacheStore, KVNamespace

    from ..backends.fsspec import FsspecBackend
    from .s3shim import S3Shim

    bucket = s3.new_bucket("bench-fleet")
    url = f"s3://{bucket}/kv"
    system = [1 + (i % 997) for i in range(SYSTEM_TOKENS)]
    chunk_bytes = chunk_tokens * 2 * 2 * 16 * 2 * 2  # K and V, 2 heads of 16, fp16, 2 layers
    working_chunks = SYSTEM_TOKENS // chunk_tokens + n * users * (rounds * TURN_TOKENS) // chunk_tokens
    budget = int(budget_share * working_chunks * (chunk_bytes + 512))  # + header
    lookups: list[float] = []
    loads: list[float] = []
    asked = hit = vanished = 0
    errors: list[BaseException] = []
    lock = threading.Lock()
    with S3Shim(s3.endpoint_url, latency=latency, bandwidth=90e6, lifetime=3600) as shim:
        opts = shim.storage_options(s3.storage_options)
        config = {"tiers": [{"kind": "host", "capacity": "8MiB"},
                            {"kind": "remote", "url": url, "storage_options": opts, "max_in_flight": 8,
                             "touch_after": TOUCH_AFTER_S,
                             "list_on_open": False}],
                  "write_policy": "write_back", "prefetch_policy": "transient", "close_timeout": 60}
        stores = [open_tiered(config) for _ in range(n)]
        ns = KVNamespace(model="fleet", dtype="float16", chunk_tokens=chunk_tokens)
        start = threading.Barrier(n + 1)
        stop_gc = threading.Event()
        passes: list[dict[str, Any]] = []

        def instance(i: int) -> None:
            nonlocal asked, hit, vanished
            kv = KVCacheStore(stores[i], ns)
            start.wait()
            began = time.perf_counter()
            try:
                history = {u: list(system) for u in range(users)}
                for r in range(rounds):
                    for u in range(users):
                        if rate > 0:  # request k of instance i is the fleet's request k * n + i
                            time.sleep(max(0.0, began + ((r * users + u) * n + i) / rate - time.perf_counter()))
                        tokens = history[u] + [1000 + (i * 7919 + u * 104729 + r * 31 + j) % 50000
                                               for j in range(TURN_TOKENS)]
                        t0 = time.perf_counter()
                        found = kv.lookup(tokens)
                        t1 = time.perf_counter()
                        if found:
                            try:
                                kv.load(tokens, n_tokens=found)
                            except MissingKeyError:  # gc removed it after the lookup: recompute
                                found = 0
                                with lock:
                                    vanished += 1
                        t2 = time.perf_counter()
                        kv.save(tokens, _layers(tokens))
                        history[u] = tokens
                        if r >= 1:
                            with lock:
                                lookups.append(t1 - t0)
                                if found:
                                    loads.append(t2 - t1)
                                asked += len(tokens)
                                hit += found
            except BaseException as exc:  # reported, not swallowed: the run fails
                errors.append(exc)

        def sidecar() -> None:
            with closing(FsspecBackend(url=url, storage_options=opts, list_on_open=False)) as gc:
                while not stop_gc.wait(gc_every):
                    before = shim.stats()
                    done = gc.collect_garbage(max_size=budget, grace=0.5)
                    after = shim.stats()
                    passes.append({"objects": done.objects, "bytes_after": done.bytes_after,
                                   "removed": done.removed_objects, "lists": after["lists"] - before["lists"],
                                   "object_gets_total": sum(after["gets"].values())})

        threads = [threading.Thread(target=instance, args=(i,)) for i in range(n)]
        gc_thread = threading.Thread(target=sidecar)
        for t in threads:
            t.start()
        gc_thread.start()
        t_start = time.perf_counter()
        start.wait()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - t_start
        for s in stores:
            s.flush(timeout=60)
        stop_gc.set()
        gc_thread.join()
        for s in stores:
            s.close()
        requests = shim.stats()["by_method"]
    if errors:
        raise errors[0]
    return {"instances": n, "rate": rate, "gc_every": gc_every, "requests": n * users * rounds,
            "lookup_ms": 1e3 * statistics.median(lookups),
            "load_ms": 1e3 * statistics.median(loads) if loads else 0.0, "hit_rate": hit / max(1, asked),
            "vanished": vanished,
            "budget": budget, "gc_passes": len(passes),
            "heads_per_request": requests.get("HEAD", 0) / (n * users * rounds),
            "lists_per_pass": statistics.mean(p["lists"] for p in passes) if passes else 0.0,
            "objects_max": max((p["objects"] for p in passes), default=0),
            "bytes_after_max": max((p["bytes_after"] for p in passes), default=0), "elapsed_s": elapsed}


def measure(s3: Any, sizes: list[int], **kw: Any) -> list[dict[str, Any]]:
    rows = []
    for n in sizes:
        rows.append(one_fleet(s3, n, **kw))
        print(f"  fleet: {n} instances, lookup {rows[-1]['lookup_ms']:.1f} ms", flush=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    base = rows[0]["lookup_ms"] if rows else 1.0
    lines = ["| instances | requests/s (fleet) | requests | lookup ms (p50) | ÷ first | HEADs per request | "
             "load ms (p50) | token hit rate | vanished before load | gc passes | LISTs per pass | objects (max) | "
             "prefix after gc / budget |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        paced = f"{r['rate']:g}" if r.get("rate") else "unpaced"
        lines.append(f"| {r['instances']} | {paced} | {r['requests']} | {r['lookup_ms']:.1f} | "
                     f"{r['lookup_ms'] / base:.2f}× | {r['heads_per_request']:.1f} | "
                     f"{r['load_ms']:.1f} | {r['hit_rate']:.2f} | {r.get('vanished', 0)} | {r['gc_passes']} | "
                     f"{r['lists_per_pass']:.1f} | "
                     f"{r['objects_max']} | {r['bytes_after_max'] / max(1, r['budget']):.2f} |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from ..testing.s3 import local_s3

    sizes = [int(x) for x in args.instances.split(",") if x]
    with local_s3() as s3:
        rows = measure(s3, sizes, users=args.users, rounds=args.rounds, chunk_tokens=args.chunk_tokens,
                       budget_share=args.budget_share, latency=args.latency, rate=args.rate,
                       gc_every=args.gc_every)
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0
