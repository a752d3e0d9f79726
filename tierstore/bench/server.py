"""``tierstore bench server``: a get through a node server (``tierstore serve``) vs the same get in process.

The server runs as its own process (as on a node); the client is this process. The in-process store is a
host tier of the same size in this process. Both hold the same chunks; each round reads them back with
``get(out=)`` — 4 MiB chunks one by one, and ``get_many(out=)`` of 64 × 256 KiB — on one store then the
other, in alternation. In process a hit is one copy out of the pool. Through the server, a chunk this client
read before is one copy straight out of the server's host pool (mapped read-only here) between two reads of
its stamp (``tierstore.serve.places``); a chunk it has not read since it was written ("first read": the
bench puts the chunks again before each round, untimed) is one request on the Unix socket, then that copy.
Targets (issue 18): 4 MiB ``get(out=)`` ≥ 0.8× in process, ``get_many`` of 64 × 256 KiB ≥ 0.7×.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from ..cliargs import positive_int


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=positive_int, default=31, help="rounds per store; medians reported (default 31)")
    p.add_argument("--json", default=None, help="also write the results as JSON here")


#: (name, chunk bytes, chunks, batched, put again before each round)
CASES = (("get(out=) 4 MiB", 4 << 20, 16, False, False),
         ("get_many(out=) 64 × 256 KiB", 256 << 10, 64, True, False),
         ("get(out=) 4 MiB, first read", 4 << 20, 16, False, True),
         ("get_many(out=) 64 × 256 KiB, first read", 256 << 10, 64, True, True))
#: issue 18's targets: through the server ÷ in process
TARGETS = {"get(out=) 4 MiB": 0.8, "get_many(out=) 64 × 256 KiB": 0.7}


def _items(size: int, count: int, tag: str) -> list[tuple[Any, dict[str, torch.Tensor]]]:
    import tierstore

    return [(tierstore.ChunkKey.from_bytes(f"bench-server-{tag}-{i}".encode()),
             {"x": torch.randint(0, 255, (size,), dtype=torch.uint8)}) for i in range(count)]


def _reader(store: Any, keys: list[Any], outs: list[dict[str, torch.Tensor]], batched: bool) -> Callable[[], float]:
    def one_round() -> float:
        start = time.perf_counter()
        if batched:
            got = store.get_many(keys, out=outs)
        else:
            got = [store.get(k, out=o) for k, o in zip(keys, outs, strict=True)]
        elapsed = time.perf_counter() - start
        if any(g is None for g in got):
            raise RuntimeError("a chunk the bench put was missed")
        return elapsed
    return one_round


def _put(stores: Any, items: list[tuple[Any, dict[str, torch.Tensor]]]) -> None:
    for store in stores:
        if store.put_many(items) != [True] * len(items):
            raise RuntimeError("the bench's chunks did not all fit")


def start_server(config: dict[str, Any], workdir: str, threads: int | None = None) -> subprocess.Popen[str]:
    """``tierstore serve`` as its own process; ``threads``: its torch intra-op threads (default: torch's)."""
    path = os.path.join(workdir, "node.json")
    if threads:
        config = {**config, "serve": {**config.get("serve", {}), "threads": threads}}
    with open(path, "w") as f:
        json.dump(config, f)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)} if threads else None
    proc = subprocess.Popen([sys.executable, "-m", "tierstore.cli", "serve", "--config", path],
                            stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "tierstore serve" not in line:
        proc.kill()
        raise RuntimeError(f"tierstore serve did not start: {line!r}")
    return proc


def measure(rounds: int = 31) -> dict[str, Any]:
    import tierstore

    host = sum(size * count for _, size, count, _, _ in CASES) * 2
    with tempfile.TemporaryDirectory() as work:
        sock = os.path.join(work, "run", "ts.sock")
        proc = start_server({"tiers": [{"kind": "host", "capacity": host, "pinned": False}],
                             "serve": {"socket": sock}}, work)
        try:
            remote = tierstore.open({"server": f"unix://{sock}"})
            local = tierstore.open({"tiers": [{"kind": "host", "capacity": host, "pinned": False}]})
            results = []
            for name, size, count, batched, again in CASES:
                items = _items(size, count, name.split()[0])
                stores = {"server": remote, "in process": local}
                _put(stores.values(), items)
                keys = [k for k, _ in items]
                outs = [{"x": torch.empty(size, dtype=torch.uint8)} for _ in items]
                read = {who: _reader(store, keys, outs, batched) for who, store in stores.items()}
                for fn in read.values():
                    fn()  # warm-up
                times: dict[str, list[float]] = {"server": [], "in process": []}
                for i in range(rounds):
                    if again:
                        _put(stores.values(), items)
                    for who in (("server", "in process") if i % 2 == 0 else ("in process", "server")):
                        times[who].append(read[who]())
                ratios = [a / b for a, b in zip(times["in process"], times["server"], strict=True)]
                total = size * count
                med = {who: statistics.median(t) for who, t in times.items()}
                results.append({"case": name, "bytes": total, "server_s": med["server"],
                                "in_process_s": med["in process"], "server_gbps": total / med["server"] / 1e9,
                                "in_process_gbps": total / med["in process"] / 1e9,
                                "ratio": statistics.median(ratios)})
            remote.close()
            local.close()
        finally:
            proc.terminate()
            proc.wait(30)
    return {"rounds": rounds, "cases": results}


def table(r: dict[str, Any]) -> str:
    rows = "".join(f"| {c['case']} | {c['in_process_gbps']:.2f} | {c['server_gbps']:.2f} | {c['ratio']:.2f}× |\n"
                   for c in r["cases"])
    return (f"{r['rounds']} rounds per store, alternating; the server is another process on this host, its host "
            "pool mapped read-only here. Ratio: median of the rounds' in-process ÷ server times.\n\n"
            "| read | in process GB/s | through the server GB/s | server ÷ in process |\n|---|---|---|---|\n" + rows)


def run(args: argparse.Namespace) -> int:
    r = measure(args.rounds)
    print(table(r))
    for c in r["cases"]:
        target = f" (target ≥ {TARGETS[c['case']]}×)" if c["case"] in TARGETS else ""
        print(f"{c['case']}: {c['ratio']:.2f}× of in process{target}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0
