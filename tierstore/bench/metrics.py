"""``tierstore bench metrics``: what the metrics cost the put/get path.

Two stores on one host tier, alike but for the metrics: *on* serves ``/metrics`` (``metrics: {port: 0}``)
with a thread scraping it every ``scrape_ms`` (far more often than any Prometheus does), latency histograms
recording; *off* records no latency and serves nothing. Each round puts ``count`` chunks of ``size`` bytes one
by one, reads them back one by one with ``get(out=)`` and once with ``get_many(out=)``, on one store then
the other, in alternation; the ratio of their round times is the cost (target: on ≥ 0.97× off). Small
chunks are the worst case: the per-call recording is all there is to see.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import urllib.request
from typing import Any

import torch

from ..cliargs import positive_int
from ..store import open_tiered


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--count", type=positive_int, default=64, help="chunks per round (default 64)")
    p.add_argument("--size", type=positive_int, default=4096, help="bytes per chunk (default 4096)")
    p.add_argument("--rounds", type=positive_int, default=101, help="rounds per store; medians reported (default 101)")
    p.add_argument("--scrape-ms", type=positive_int, default=100, help="scrape period of the 'on' store (default 100)")
    p.add_argument("--json", default=None, help="also write the results as JSON here")


def _round(store: Any, items: list[tuple[Any, dict[str, torch.Tensor]]], outs: list[dict[str, torch.Tensor]]) -> float:
    start = time.perf_counter()
    for k, v in items:
        store.put(k, v)
    for (k, _), out in zip(items, outs, strict=True):
        store.get(k, out=out)
    store.get_many([k for k, _ in items], out=outs)
    return time.perf_counter() - start


def measure(count: int = 64, size: int = 4096, rounds: int = 101, scrape_ms: int = 100) -> dict[str, Any]:
    import tierstore

    config = {"tiers": [{"kind": "host", "capacity": 4 * count * size}]}
    items = [(tierstore.ChunkKey.from_bytes(b"bench-metrics-%d" % i),
              {"x": torch.randint(0, 255, (size,), dtype=torch.uint8)}) for i in range(count)]
    outs = [{"x": torch.empty(size, dtype=torch.uint8)} for _ in range(count)]
    on = open_tiered({**config, "metrics": {"port": 0}})
    off = open_tiered(config)
    for lat in [off.latency, *(t.latency for t in off.tiers)]:
        lat.enabled = False
    stop = threading.Event()
    scrapes = [0]
    assert on.metrics is not None
    url = f"http://127.0.0.1:{on.metrics.port}/metrics"

    def scrape() -> None:
        while not stop.wait(scrape_ms / 1e3):
            with urllib.request.urlopen(url, timeout=5) as r:
                r.read()
            scrapes[0] += 1

    scraper = threading.Thread(target=scrape, daemon=True)
    scraper.start()
    times: dict[str, list[float]] = {"on": [], "off": []}
    try:
        for store in (on, off):  # warm-up
            _round(store, items, outs)
        for i in range(rounds):
            order = (("on", on), ("off", off)) if i % 2 == 0 else (("off", off), ("on", on))
            for name, store in order:
                times[name].append(_round(store, items, outs))
    finally:
        stop.set()
        scraper.join(5)
        on.close()
        off.close()
    med = {name: statistics.median(t) for name, t in times.items()}
    ratios = [off_t / on_t for on_t, off_t in zip(times["on"], times["off"], strict=True)]
    return {"count": count, "size": size, "rounds": rounds, "scrape_ms": scrape_ms, "scrapes": scrapes[0],
            "on_s": med["on"], "off_s": med["off"], "on_vs_off": statistics.median(ratios),
            "us_per_call_on": 1e6 * med["on"] / (2 * count + 1), "us_per_call_off": 1e6 * med["off"] / (2 * count + 1)}


def table(r: dict[str, Any]) -> str:
    return (f"{r['rounds']} rounds of {r['count']} puts + {r['count']} get(out=) + 1 get_many(out=) of "
            f"{r['size']} B chunks (host tier), alternating; metrics on = /metrics served and scraped every "
            f"{r['scrape_ms']} ms ({r['scrapes']} scrapes), latency histograms recording.\n\n"
            "The ratio is the median of the rounds' off ÷ on time ratios.\n\n"
            "| store | round ms (median) | µs per call | ÷ off |\n|---|---|---|---|\n"
            f"| metrics off | {1e3 * r['off_s']:.1f} | {r['us_per_call_off']:.1f} | 1.00× |\n"
            f"| metrics on | {1e3 * r['on_s']:.1f} | {r['us_per_call_on']:.1f} | {r['on_vs_off']:.3f}× |")


def run(args: argparse.Namespace) -> int:
    r = measure(args.count, args.size, args.rounds, args.scrape_ms)
    print(table(r))
    print(f"\nmetrics on ÷ off throughput: {r['on_vs_off']:.3f}× (target ≥ 0.97×)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0
