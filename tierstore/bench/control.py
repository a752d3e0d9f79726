"""``tierstore bench control``: the control plane's cost as the index grows — ``lookup`` time per key and
index memory per key at 10k, 100k and 1M keys.

The index is the store's control plane (:class:`tierstore.residency.Residency`: per tier, the copies it
holds in LRU order). Keys are registered with ``store.residency.adopt`` on the disk tier, the way a store
opening a disk directory registers what its backend lists, so a million-key index is measured without
writing a million files. Memory is what ``tracemalloc`` sees the index allocate, the keys included (the
index keeps them alive), the bench's list of them excluded.
``lookup`` is timed on prompts of ``--prompt-chunks`` keys (a 32k-token prompt is 128 chunks of 256
tokens) at random places in the index, through ``TieredStore.lookup`` as an engine's scheduler calls it.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import random
import sys
import tempfile
import time
import tracemalloc
from typing import Any

from ..cliargs import positive_float, positive_int
from ..keys import ChunkKey
from ..store import open_tiered


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default="10000,100000,1000000", help="index sizes in keys (comma list)")
    p.add_argument("--prompt-chunks", type=positive_int, default=128, help="keys per lookup (default 128)")
    p.add_argument("--seconds", type=positive_float, default=0.5, help="time spent timing lookups per size")
    p.add_argument("--json", default=None, help="also write the results as JSON here")


def measure(n_keys: int, prompt_chunks: int = 128, seconds: float = 0.5, workdir: str | None = None) -> dict[str, Any]:
    """Index memory per key and ``lookup`` µs per key for an index of ``n_keys`` chunks of 1 MiB."""

    with tempfile.TemporaryDirectory(prefix="tierstore-bench-control-", dir=workdir) as tmp:
        cfg = {"tiers": [{"kind": "disk", "path": os.path.join(tmp, "disk"), "capacity": n_keys << 20}]}
        with open_tiered(cfg) as store:
            index = store.tier("disk").index
            gc.collect()
            tracemalloc.start()
            before = tracemalloc.get_traced_memory()[0]
            keys = [ChunkKey(hashlib.blake2b(i.to_bytes(8, "little"), digest_size=32).digest())
                    for i in range(n_keys)]
            store.residency.adopt(index, ((k, 1 << 20) for k in keys))  # as opening the store registers them
            gc.collect()
            index_bytes = tracemalloc.get_traced_memory()[0] - before - sys.getsizeof(keys)  # the bench's own list
            tracemalloc.stop()
            span = min(prompt_chunks, n_keys)
            rng = random.Random(0)
            assert store.lookup(keys[:span]) == span
            done, t0 = 0, time.perf_counter()
            times: list[float] = []
            while time.perf_counter() - t0 < seconds or len(times) < 5:
                start = rng.randrange(n_keys - span + 1)
                prompt = keys[start:start + span]
                t1 = time.perf_counter()
                hit = store.lookup(prompt)
                times.append((time.perf_counter() - t1) / span)
                done += hit
            times.sort()
            return {"keys": n_keys, "index_bytes_per_key": index_bytes / n_keys,
                    "lookup_us_per_key": 1e6 * times[len(times) // 2], "lookups": len(times),
                    "prompt_chunks": span}


def run(args: argparse.Namespace) -> int:
    import json

    sizes = [int(x) for x in str(args.sizes).split(",") if x.strip()]
    rows = []
    print(f"{'keys':>10}  {'lookup us/key':>13}  {'index B/key':>11}")
    for n in sizes:
        r = measure(n, args.prompt_chunks, args.seconds)
        rows.append(r)
        print(f"{n:>10,}  {r['lookup_us_per_key']:>13.3f}  {r['index_bytes_per_key']:>11.0f}", flush=True)
    print("targets: lookup <= 2 us/key at 1M keys, index <= 200 B/key")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=2)
    return 0
