"""``tierstore demo``: a multi-round chat with a small transformer, its KV cache served from the store.

Each round sends the whole conversation (system prompt, history, a new user turn) as the prompt. The
engine looks the prompt up, loads the cached prefix's KV, prefills only the rest and saves the new
chunks; the reply is decoded greedily and appended to the history. Every round is also checked:

* **bit-identical**: continuing from the KV loaded from the store gives ``torch.equal`` logits to
  continuing from the KV the engine computed itself (the same split without the store);
* **≈ recompute**: those logits match a full recompute of the prompt within
  :data:`~tierstore.models.RECOMPUTE_TOLERANCE` (float32: 1e-4, bfloat16: 5e-2).

Half-way the engine restarts: the host tier is lost, the disk tier reopens and serves the next round.
Runs on the embedded default layout in a fresh temporary directory, removed at the end, so every run
starts cold and checks every round. ``--cache-dir DIR`` keeps the store in DIR (a second run then finds the
conversation already on disk: those rounds cannot be compared with KV this process computed, and the
summary says so); ``--config`` runs on any store.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from typing import Any

import torch

from .cliargs import nonneg_int, positive_int


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=positive_int, default=6, help="chat rounds (default 6)")
    p.add_argument("--system-tokens", type=positive_int, default=1024, help="system prompt length (default 1024)")
    p.add_argument("--user-tokens", type=positive_int, default=96, help="tokens per user turn (default 96)")
    p.add_argument("--answer-tokens", type=positive_int, default=24, help="tokens decoded per reply (default 24)")
    p.add_argument("--chunk-tokens", type=positive_int, default=128, help="KV chunk size in tokens (default 128)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--restart-after", type=nonneg_int, default=None,
                   help="restart the engine (empty host tier) after this round (default rounds/2; 0 = never)")
    p.add_argument("--seed", type=int, default=0, help="seed of the conversation's tokens")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--config", help="store config (YAML/JSON path); default: the embedded default")
    where.add_argument("--cache-dir", help="use the embedded default layout under this directory")
    p.add_argument("--json", metavar="PATH", help="also write per-round results as JSON")


def _open_store(args, root: str | None):
    import tierstore
    if root:
        from tierstore.config import default_config
        return tierstore.open(default_config(root))
    return tierstore.open(args.config)


def _where(args, root: str | None) -> str:
    """Where the demo's store lives."""
    if args.cache_dir:
        return f"under {args.cache_dir} (kept: a second run finds this run's chunks there)"
    if root:
        return f"under {root} (a fresh directory, removed at the end; --cache-dir DIR keeps one)"
    return f"from {args.config}"


def _ratio(x: float) -> str:
    """``2.9× faster`` or, below 1, ``1.7× slower``."""
    return f"{x:.1f}× faster" if x >= 1 else f"{1 / x:.1f}× slower"


#: width of the "from tier" column ("host:1024+disk:128" fits)
TIER_W = 20


def _tiers(tiers: dict[str | None, int]) -> str:
    if not tiers:
        return "-"
    return "+".join(f"{name}" if len(tiers) == 1 else f"{name}:{n}" for name, n in tiers.items())


def run(args) -> int:
    from tierstore import KVNamespace
    from tierstore.models import RECOMPUTE_TOLERANCE, TinyConfig, TinyDecoder

    dtype = getattr(torch, args.dtype)
    tol = RECOMPUTE_TOLERANCE[dtype]
    restart = args.rounds // 2 if args.restart_after is None else args.restart_after
    cfg = TinyConfig()
    model = TinyDecoder(cfg, dtype=dtype)
    ns = KVNamespace(**model.namespace_fields(), layout="mha")
    gen = torch.Generator().manual_seed(args.seed)
    history = torch.randint(0, cfg.vocab_size, (args.system_tokens,), generator=gen)

    warm = torch.arange(96) % cfg.vocab_size  # first calls pay one-time setup; keep it out of the timings
    model.prefill(warm[32:], model.prefill(warm[:32]).kv)
    root = args.cache_dir or (None if args.config else tempfile.mkdtemp(prefix="tierstore-demo-"))
    try:
        return _run(args, model, ns, gen, history, tol, restart, root)
    finally:
        if root and not args.cache_dir:
            shutil.rmtree(root, ignore_errors=True)


def _run(args, model: Any, ns: Any, gen: torch.Generator, history: torch.Tensor, tol: float, restart: int,
         root: str | None) -> int:
    from tierstore import KVCacheStore
    from tierstore.models import TinyEngine

    cfg, dtype = model.config, getattr(torch, args.dtype)
    store = _open_store(args, root)
    print(f"tierstore demo: {cfg.name} ({cfg.num_hidden_layers} layers, {cfg.num_attention_heads} heads / "
          f"{cfg.num_key_value_heads} KV heads, {args.dtype}, random weights), "
          f"{cfg.kv_bytes_per_token(dtype) / 1024:.0f} KiB of KV per token")
    kinds = {t.kind for t in store.tiers}
    print(f"store: {' > '.join(t.name for t in store.tiers)} {_where(args, root)}; chunks of "
          f"{args.chunk_tokens} tokens")
    print(f"each round: logits checked bit-identical to the no-store split and within {tol:g} of a full recompute")
    header = (f"{'round':>5} {'prompt':>7} {'cached':>7}  {'from tier':<{TIER_W}} {'w/ cache':>9} {'recompute':>10} "
              f"{'speedup':>8}  {'bit-exact':^9} {'≈ full':^8} {'max|Δ|':>8}")
    print(header)
    print("-" * len(header))
    # reference: the KV this process computed itself, as an engine without the store would have kept it
    rows: list[dict[str, Any]] = []
    reference = None
    try:
        engine = TinyEngine(model, KVCacheStore(store, ns, chunk_tokens=args.chunk_tokens))
        for r in range(1, args.rounds + 1):
            user = torch.randint(0, cfg.vocab_size, (args.user_tokens,), generator=gen)
            prompt = torch.cat([history, user])
            res = engine.prefill(prompt)
            exact = None  # nothing loaded, or KV saved by an earlier run: no own copy to compare with
            hit = res.cached_tokens
            if hit and reference is not None and reference[0].shape[1] >= hit:
                own = model.prefill(prompt[hit:], [t[:, :hit] for t in reference], last_only=True)
                exact = torch.equal(own.logits, res.logits)
            t0 = time.perf_counter()
            full = model.prefill(prompt, last_only=True)
            recompute_s = time.perf_counter() - t0
            diff = (full.logits - res.logits).abs().max().item()
            close = diff <= tol
            reply, _ = engine.decode(res, args.answer_tokens)
            history = torch.cat([prompt, torch.tensor(reply, dtype=torch.long)])
            reference = res.kv
            row = {"round": r, "prompt_tokens": res.prompt_tokens, "cached_tokens": res.cached_tokens,
                   "tiers": res.tiers, "ttft_cache_s": res.ttft_s, "load_s": res.load_s,
                   "prefill_s": res.compute_s, "recompute_s": recompute_s, "bit_identical": exact,
                   "within_tolerance": close, "max_abs_diff": diff}
            rows.append(row)
            mark = lambda ok: "n/a" if ok is None else "✓" if ok else "✗"  # noqa: E731
            print(f"{r:>5} {res.prompt_tokens:>7} {res.cached_tokens:>7}  {_tiers(res.tiers):<{TIER_W}} "
                  f"{res.ttft_s * 1e3:>7.1f}ms {recompute_s * 1e3:>8.1f}ms {recompute_s / res.ttft_s:>7.1f}×  "
                  f"{mark(exact) if hit else '-':^9} {mark(close):^8} {diff:>8.1e}", flush=True)
            if r == restart and r < args.rounds:
                store.close()
                store = _open_store(args, root)
                engine = TinyEngine(model, KVCacheStore(store, ns, chunk_tokens=args.chunk_tokens))
                below = ("disk tier reopened from its files" if "disk" in kinds else
                         "remote tier reopened" if "remote" in kinds else "no persistent tier in this config")
                print(f"{'':>5} -- engine restarted: host tier empty, {below} --")
    finally:
        store.close()
    prompt_tok = sum(r["prompt_tokens"] for r in rows)
    cached_tok = sum(r["cached_tokens"] for r in rows)
    with_cache = sum(r["ttft_cache_s"] for r in rows)
    recompute = sum(r["recompute_s"] for r in rows)
    checked = [r for r in rows if r["bit_identical"] is not None]
    n_exact = sum(r["bit_identical"] for r in checked)
    n_close = sum(r["within_tolerance"] for r in rows)
    ok = n_exact == len(checked) and n_close == len(rows)
    unchecked = sum(1 for r in rows if r["cached_tokens"] and r["bit_identical"] is None)
    exact_text = f"logits bit-identical {n_exact}/{len(checked)}" + (
        f" ({unchecked} rounds served by an earlier run's chunks not compared: run without --cache-dir for "
        "a fresh store)" if unchecked else "")
    print("-" * len(header))
    print(f"{'✓' if ok else '✗'} {len(rows)} rounds: {cached_tok}/{prompt_tok} prompt tokens served from the "
          f"cache ({cached_tok / prompt_tok:.0%}); prefill {with_cache:.2f}s with the cache vs {recompute:.2f}s "
          f"recompute ({_ratio(recompute / with_cache)}); {exact_text}, "
          f"within {tol:g} of recompute {n_close}/{len(rows)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": rows, "tolerance": tol, "dtype": args.dtype, "ok": ok}, f, indent=2)
    return 0 if ok else 1
