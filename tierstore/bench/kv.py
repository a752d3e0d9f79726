"""``tierstore bench kv``: multi-round-chat TTFT with the tiny model, without and with the store.

The workload follows LMCache's ``bench engine`` *multi_round_chat* at laptop scale: each session has its
own system prompt and chat history; the number of sessions is sized so that their prompts fill a target
KV volume (``sessions = volume × tokens_per_GiB / (system + history)``); requests go round-robin over the
sessions at a fixed QPS with at most one request per session in flight (a busy session is retried every
10 ms); each answer is appended to the history, so every round's prompt extends the previous one. One
warm-up request per session precedes the measurement.

The engine is one worker thread running the real tiny decoder on CPU (one request at a time, like one
GPU): TTFT = queueing + lookup + KV load + prefill of the uncached tokens. Answers are synthetic tokens
(decode is not simulated; it would not change TTFT, only the engine's busy time). Scenarios:

* ``none``: no cache;
* ``host``: host tier only, smaller than the working set (``--host-fraction``): round-robin LRU thrashes;
* ``host+disk``: the same host tier over a disk tier that holds the working set;
* ``host+disk+remote``: the same host tier, a disk tier half the working set, a shared remote tier
  (``--remote-url``, default a ``file://`` directory) below.

A third table (``--paged-tokens``, default 8192) times getting a cached prompt's KV into an engine's paged
cache (``vllm`` layout, block size 16) from each tier alone: today's path (``load`` then
``scatter_layers``), ``load_into``, and layer-wise ``load_into`` over per-layer objects (time until layer 0
is usable and until every layer is); medians of ``--paged-repeats`` rounds after a warm-up round, the three
paths in alternation, each round starting with the next path. TTFT adds the measured compute of the last
token to the time the KV is in; layer-wise, the model really runs each layer as soon as its KV is in (what
an engine's layer-wise connector allows), so TTFT is measured end to end with compute and loading sharing
the CPU.

A second table reports, per chunk size, the time to load one chunk from each tier against the time to
prefill it (the ratio shows how much cheaper loading is than recomputing).
"""

from __future__ import annotations

import argparse
import json
import queue
import tempfile
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch

from ..store import open_tiered

SCENARIOS = ("none", "host", "host+disk", "host+disk+remote")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-volume", default="12MiB", help="target KV volume of the active sessions (default 12MiB)")
    p.add_argument("--tokens-per-gib", type=int, default=None,
                   help="tokens of KV per GiB (default: from the model, 1024**3 // bytes per token)")
    p.add_argument("--system-tokens", type=int, default=512, help="per-session system prompt (default 512)")
    p.add_argument("--history-tokens", type=int, default=512, help="initial chat history (default 512)")
    p.add_argument("--user-tokens", type=int, default=32, help="user input per round (default 32)")
    p.add_argument("--output-tokens", type=int, default=32, help="answer appended per round (default 32)")
    p.add_argument("--rounds", type=int, default=3, help="measured rounds per session (default 3)")
    p.add_argument("--qps", type=float, default=1.0, help="request rate (default 1, as LMCache)")
    p.add_argument("--chunk-tokens", type=int, default=256, help="KV chunk size (default 256)")
    p.add_argument("--host-fraction", type=float, default=0.3,
                   help="host tier capacity as a fraction of the working set (default 0.3)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma list of {', '.join(SCENARIOS)}")
    p.add_argument("--remote-url", default=None, help="remote tier URL (default: a file:// dir under --workdir)")
    p.add_argument("--remote-storage-options", type=json.loads, default=None, metavar="JSON",
                   help='fsspec storage_options of the remote tier, e.g. \'{"endpoint_url": "http://..."}\'')
    p.add_argument("--workdir", default=None, help="where disk/remote tiers live (default: a temp dir)")
    p.add_argument("--chunk-sizes", default="64,128,256,512",
                   help="chunk sizes of the load-vs-prefill table ('' to skip)")
    p.add_argument("--paged-tokens", type=int, default=8192,
                   help="cached prompt of the paged-load table (0 to skip; default 8192)")
    p.add_argument("--paged-repeats", type=int, default=7, help="repeats of the paged-load table (median)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write all results as JSON")


# ---------------------------------------------------------------------------------------------- workload
@dataclass
class Session:
    index: int
    tokens: torch.Tensor  # system prompt + history so far
    busy: bool = False


@dataclass
class Request:
    session: Session
    round: int
    prompt: torch.Tensor
    arrival: float
    ttft: float = 0.0
    cached: int = 0
    tiers: dict = field(default_factory=dict)


def make_sessions(n: int, args, vocab: int) -> list[Session]:
    gen = torch.Generator().manual_seed(args.seed)
    return [Session(i, torch.randint(0, vocab, (args.system_tokens + args.history_tokens,), generator=gen))
            for i in range(n)]


def synthetic(n: int, seed: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def run_workload(engine, sessions: list[Session], args, vocab: int) -> list[Request]:
    """Warm up one request per session, then ``rounds`` rounds round-robin at ``qps``; returns requests."""
    for s in sessions:  # warm-up (LMCache sends each session once with max_tokens=1), not measured
        engine.prefill(s.tokens)
    work: queue.Queue = queue.Queue()
    done: list[Request] = []

    def worker():
        while (req := work.get()) is not None:
            res = engine.prefill(req.prompt)
            req.ttft = time.perf_counter() - req.arrival
            req.cached, req.tiers = res.cached_tokens, res.tiers
            answer = synthetic(args.output_tokens, 1_000_003 * req.session.index + req.round, vocab)
            req.session.tokens = torch.cat([req.prompt, answer])
            done.append(req)
            req.session.busy = False

    thread = threading.Thread(target=worker, name="bench-engine", daemon=True)
    thread.start()
    interval, next_at = 1.0 / args.qps, time.perf_counter()
    for r in range(args.rounds):
        for s in sessions:
            while s.busy:  # one request per session in flight; retry the same session
                time.sleep(0.01)
            next_at = max(next_at, time.perf_counter())
            time.sleep(max(0.0, next_at - time.perf_counter()))
            user = synthetic(args.user_tokens, 7_000_001 * s.index + r, vocab)
            s.busy = True
            work.put(Request(s, r, torch.cat([s.tokens, user]), time.perf_counter()))
            next_at += interval
    work.put(None)
    thread.join()
    return done


def percentiles(values: list[float]) -> dict:
    a = np.asarray(values)
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99))}


# ---------------------------------------------------------------------------------------------- stores
def store_config(scenario: str, root: Path, working_set: int, args) -> dict | None:
    host = {"kind": "host", "capacity": max(1 << 20, int(working_set * args.host_fraction))}
    disk_path = str(root / scenario.replace("+", "_") / "disk")
    tiers = {
        "none": None,
        "host": [host],
        "host+disk": [host, {"kind": "disk", "path": disk_path, "capacity": 4 * working_set}],
        "host+disk+remote": [host, {"kind": "disk", "path": disk_path, "capacity": working_set // 2},
                             _remote(args, root)],
    }[scenario]
    return None if tiers is None else {"tiers": tiers, "write_policy": "write_back"}


def _remote(args, root: Path) -> dict:
    tier = {"kind": "remote", "url": args.remote_url or f"file://{root / 'remote'}"}
    if args.remote_storage_options:
        tier["storage_options"] = args.remote_storage_options
    return tier


def run_scenario(scenario: str, model, ns, root: Path, working_set: int, sessions_n: int, args) -> dict:
    import tierstore
    from tierstore.models import TinyEngine

    cfg = store_config(scenario, root, working_set, args)
    (root / "remote").mkdir(parents=True, exist_ok=True)
    store = open_tiered(cfg) if cfg else None
    try:
        kv = tierstore.KVCacheStore(store, ns, chunk_tokens=args.chunk_tokens) if store else None
        sessions = make_sessions(sessions_n, args, model.config.vocab_size)
        t0 = time.perf_counter()
        reqs = run_workload(TinyEngine(model, kv), sessions, args, model.config.vocab_size)
        wall = time.perf_counter() - t0
    finally:
        if store is not None:
            store.close()
    prompt = sum(len(r.prompt) for r in reqs)
    by_tier: dict[str, int] = {}
    for r in reqs:
        for t, n in r.tiers.items():
            by_tier[t] = by_tier.get(t, 0) + n
    return {"scenario": scenario, "requests": len(reqs), "wall_s": wall,
            "ttft_s": percentiles([r.ttft for r in reqs]),
            "hit_rate": sum(r.cached for r in reqs) / prompt,
            "hit_rate_by_tier": {t: n / prompt for t, n in sorted(by_tier.items())}}


# ---------------------------------------------------------------------------------------------- chunk costs
def chunk_costs(model, ns, root: Path, sizes: list[int], args, repeats: int = 7) -> list[dict]:
    """Per chunk size: time to prefill one chunk (no past) vs to load it from each tier alone.

    Best of ``repeats`` for both: on a shared machine the minimum is the least disturbed estimate.
    """
    import tierstore

    rows = []
    vocab = model.config.vocab_size
    for size in sizes:
        toks = synthetic(size, 99 + size, vocab)
        model.prefill(toks)  # warm
        prefill = min(_timed(partial(model.prefill, toks, last_only=True)) for _ in range(repeats))
        row = {"chunk_tokens": size, "chunk_bytes": size * model.config.kv_bytes_per_token(model.dtype),
               "prefill_s": prefill}
        layers = model.prefill(toks).kv
        tiers = {"host": {"kind": "host", "capacity": "256MiB"},
                 "disk": {"kind": "disk", "path": str(root / f"cost{size}" / "disk"), "capacity": "256MiB"},
                 "remote": {"kind": "remote", "url": f"file://{root / f'cost{size}' / 'remote'}"}}
        for name, tier in tiers.items():
            with open_tiered({"tiers": [tier]}) as store:
                kv = tierstore.KVCacheStore(store, ns.replace(tenant=f"cost-{size}"), chunk_tokens=size)
                kv.save(toks, layers)
                store.flush()
                row[f"{name}_load_s"] = min(_timed(partial(kv.load, toks)) for _ in range(repeats))
            row[f"{name}_ratio"] = row[f"{name}_load_s"] / prefill
        rows.append(row)
    return rows


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------- paged load
def paged_rows(model, ns, root: Path, n: int, repeats: int) -> list[dict]:
    """Median time to land the KV of a cached ``n``-token prompt in a paged cache, per tier and path."""
    import statistics

    import tierstore
    from tierstore.kv import scatter_layers

    cfg, bs = model.config, 16
    toks = synthetic(n, 4242, cfg.vocab_size)
    gen = torch.Generator().manual_seed(1)
    layers = [torch.randn(2, n, cfg.num_key_value_heads, cfg.head_dim, generator=gen).to(model.dtype)
              for _ in range(cfg.num_hidden_layers)]
    blocks = -(-n // bs)
    table = torch.randperm(blocks, generator=gen).tolist()
    caches = [torch.zeros(2, blocks, bs, cfg.num_key_value_heads, cfg.head_dim, dtype=model.dtype)
              for _ in layers]
    past = [t[:, :n - 1] for t in layers]
    model.prefill(toks[n - 1:], past, last_only=True)  # warm-up
    compute = statistics.median(_timed(lambda: model.prefill(toks[n - 1:], past, last_only=True))
                                for _ in range(repeats))
    rows = []
    for tier_name in ("host", "disk"):
        tier = ({"kind": "host", "capacity": 4 * n * cfg.kv_bytes_per_token(model.dtype) + (64 << 20)}
                if tier_name == "host" else
                {"kind": "disk", "path": str(root / f"paged-{tier_name}"), "capacity": "16GiB"})
        with open_tiered({"tiers": [tier]}) as store:
            flat = tierstore.KVCacheStore(store, ns.replace(tenant="paged"), chunk_tokens=256)
            per_layer = tierstore.KVCacheStore(store, ns.replace(tenant="paged-layers"), chunk_tokens=256,
                                               layers_per_object=1, num_layers=len(layers))
            flat.save(toks, layers)
            per_layer.save(toks, layers)
            store.flush()

            def old(flat=flat) -> None:
                got = flat.load(toks, n - 1)
                scatter_layers(caches, "vllm", table, got)

            def layerwise(per_layer=per_layer) -> tuple[float, float, float]:
                """(layer 0 usable, every layer in, first token): the model runs each layer as soon as
                its KV is in, as an engine's layer-wise connector lets it, while later layers still load."""
                t0 = time.perf_counter()
                h = per_layer.load_into(toks, caches, "vllm", table, n_tokens=n - 1, layerwise=True)
                ready = [0.0] * len(layers)

                def wait(i: int) -> None:
                    h.wait_for_layer(i)
                    ready[i] = time.perf_counter() - t0

                model.prefill(toks[n - 1:], past, last_only=True, before_layer=wait)
                first_token = time.perf_counter() - t0
                h.result()
                return ready[0], time.perf_counter() - t0, first_token

            def into(flat=flat) -> None:
                flat.load_into(toks, caches, "vllm", table, n_tokens=n - 1)

            runs: dict[str, list[float]] = {"load+scatter": [], "load_into": []}
            lw: list[tuple[float, float, float]] = []
            paths = [("load+scatter", old), ("load_into", into), ("layerwise", layerwise)]
            for r in range(repeats + 1):  # a warm-up round, then the paths in alternation, each round starting
                for k in range(len(paths)):  # with the next one: the machine's drift hits them alike
                    name, fn = paths[(r + k) % len(paths)]
                    if name == "layerwise":
                        got = layerwise()
                        if r:
                            lw.append(got)
                    else:
                        t = _timed(fn)
                        if r:
                            runs[name].append(t)
            timings = {path: statistics.median(ts) for path, ts in runs.items()}
            timings["load_into layerwise"] = statistics.median(a for _, a, _ in lw)
            first = statistics.median(f for f, _, _ in lw)
            overlapped = statistics.median(t for _, _, t in lw)
            base = timings["load+scatter"] + compute
            for path, t in timings.items():
                ttft = overlapped if "layerwise" in path else t + compute
                rows.append({"tier": tier_name, "path": path, "kv_ready_s": t,
                             "first_layer_s": first if "layerwise" in path else t,
                             "ttft_s": ttft, "speedup": base / ttft})
    return rows


def paged_table(rows: list[dict]) -> str:
    head = ["tier", "path", "KV in cache", "layer 0 usable", "TTFT (+compute)", "vs load+scatter"]
    body = [[r["tier"], r["path"], f"{1e3 * r['kv_ready_s']:.1f} ms", f"{1e3 * r['first_layer_s']:.1f} ms",
             f"{1e3 * r['ttft_s']:.1f} ms", f"{r['speedup']:.2f}×"] for r in rows]
    return _format(head, body)


# ---------------------------------------------------------------------------------------------- output
def ttft_table(results: list[dict]) -> str:
    order = ["host", "disk", "remote"]
    tiers = order + sorted({t for r in results for t in r["hit_rate_by_tier"]} - set(order))
    head = ["scenario", "reqs", "hit %"] + [f"{t} %" for t in tiers] + \
        ["TTFT mean", "P50", "P90", "P99", "P50 vs none"]
    base = next((r["ttft_s"]["p50"] for r in results if r["scenario"] == "none"), None)
    body = []
    for r in results:
        t = r["ttft_s"]
        body.append([r["scenario"], str(r["requests"]), f"{100 * r['hit_rate']:.0f}"]
                    + [f"{100 * r['hit_rate_by_tier'].get(x, 0):.0f}" for x in tiers]
                    + [f"{1e3 * t[k]:.0f} ms" for k in ("mean", "p50", "p90", "p99")]
                    + [f"{base / t['p50']:.1f}×" if base else "-"])
    return _format(head, body)


def cost_table(rows: list[dict]) -> str:
    head = ["chunk tokens", "KV bytes", "prefill", "load host", "load disk", "load remote",
            "host/prefill", "disk/prefill", "remote/prefill"]
    body = [[str(r["chunk_tokens"]), f"{r['chunk_bytes'] / 1024:.0f} KiB", f"{1e3 * r['prefill_s']:.2f} ms"]
            + [f"{1e3 * r[f'{t}_load_s']:.2f} ms" for t in ("host", "disk", "remote")]
            + [f"{r[f'{t}_ratio']:.3f}" for t in ("host", "disk", "remote")] for r in rows]
    return _format(head, body)


def _format(head: list[str], body: list[list[str]]) -> str:
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
    line = lambda cells: "  ".join(c.rjust(w) if i else c.ljust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths, strict=True)))
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(b) for b in body])


def run(args) -> int:
    from tierstore import KVNamespace
    from tierstore.models import TinyConfig, TinyDecoder
    from tierstore.sizes import parse_size

    if args.threads:
        torch.set_num_threads(args.threads)
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    bad = [s for s in scenarios if s not in SCENARIOS]
    if bad or args.qps <= 0 or args.rounds < 1 or not args.host_fraction > 0:
        raise SystemExit(f"tierstore bench kv: bad --scenarios {bad} / --qps / --rounds / --host-fraction")
    model = TinyDecoder(TinyConfig())
    ns = KVNamespace(**model.namespace_fields())
    per_token = model.config.kv_bytes_per_token(model.dtype)
    tokens_per_gib = args.tokens_per_gib or (1 << 30) // per_token
    volume = parse_size(args.kv_volume, key="--kv-volume")
    base_len = args.system_tokens + args.history_tokens
    sessions = max(1, int(volume / (1 << 30) * tokens_per_gib / base_len))
    final_len = base_len + args.rounds * (args.user_tokens + args.output_tokens)
    working_set = sessions * final_len * per_token
    meta = {"model": model.config.name, "kv_bytes_per_token": per_token, "tokens_per_gib": tokens_per_gib,
            "sessions": sessions, "rounds": args.rounds, "qps": args.qps, "chunk_tokens": args.chunk_tokens,
            "working_set_bytes": working_set, "host_capacity_bytes": int(working_set * args.host_fraction),
            "torch_threads": torch.get_num_threads(), "paged_tokens": args.paged_tokens,
            "paged_repeats": args.paged_repeats}
    print(f"bench kv: {sessions} sessions × {args.rounds} rounds at {args.qps:g} QPS; prompts "
          f"{base_len}→{final_len} tokens; working set {working_set / 2**20:.1f} MiB "
          f"({per_token} B/token); host tier {args.host_fraction:.0%} of it; chunks of {args.chunk_tokens}")
    results, costs, paged = [], [], []
    with tempfile.TemporaryDirectory(prefix="tierstore-bench-kv-", dir=args.workdir) as tmp:
        root = Path(tmp)
        for sc in scenarios:
            print(f"  running {sc} ...", flush=True)
            results.append(run_scenario(sc, model, ns, root, working_set, sessions, args))
        sizes = [int(x) for x in args.chunk_sizes.split(",") if x.strip()]
        if sizes:
            print("  measuring load vs prefill per chunk ...", flush=True)
            costs = chunk_costs(model, ns, root, sizes, args)
        if args.paged_tokens:
            print(f"  measuring the paged load of a cached {args.paged_tokens}-token prompt ...", flush=True)
            paged = paged_rows(model, ns, root, args.paged_tokens, args.paged_repeats)
    print("\nTTFT, multi-round chat (time to first token = queueing + lookup + load + prefill)")
    print(ttft_table(results))
    p50 = {r["scenario"]: r["ttft_s"]["p50"] for r in results}
    if "host+disk" in p50:
        vs = [f"{p50[b] / p50['host+disk']:.1f}× lower than {b}" for b in ("none", "host") if b in p50]
        if vs:
            print(f"host+disk TTFT P50: {', '.join(vs)}")
    if costs:
        print("\nLoad one chunk vs prefill it (best of 7; ratio < 1: loading is cheaper than recomputing)")
        print(cost_table(costs))
    if paged:
        print(f"\nKV of a cached {args.paged_tokens}-token prompt into a paged cache (vllm layout, median of "
              f"{args.paged_repeats}; TTFT adds the last token's compute, layer-wise it overlaps the load)")
        print(paged_table(paged))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "scenarios": results, "chunk_costs": costs, "paged_load": paged}, f, indent=2)
    return 0
