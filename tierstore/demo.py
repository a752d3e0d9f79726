"""``tierstore demo``: a multi-round chat with a small transformer, its KV cache served from the store.

Each round sends the whole conversation (system prompt, history, a new user turn) as the prompt. The
engine looks the prompt up, loads the cached prefix's KV, prefills only the rest and saves the new
chunks; the reply is decoded greedily and appended to the history. Every round is also checked:

* **bit-identical**: continuing from the KV loaded from the store gives ``torch.equal`` logits to
  continuing from the KV the engine computed itself (the same split without the store);
* **≈ recompute**: those logits match a full recompute of the prompt within
  :data:`~tierstore.models.RECOMPUTE_TOLERANCE` (float32: 1e-4, bfloat16: 5e-2).

Half-way the engine restarts: the host tier is lost, the disk tier reopens and serves the next round.
Runs on the embedded default store (``~/.cache/tierstore``) unless ``--config`` or ``--cache-dir`` says
otherwise; a second run finds the shared system prompt already on disk.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=6, help="chat rounds (default 6)")
    p.add_argument("--system-tokens", type=int, default=1024, help="system prompt length (default 1024)")
    p.add_argument("--user-tokens", type=int, default=96, help="tokens per user turn (default 96)")
    p.add_argument("--answer-tokens", type=int, default=24, help="tokens decoded per reply (default 24)")
    p.add_argument("--chunk-tokens", type=int, default=128, help="KV chunk size in tokens (default 128)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--restart-after", type=int, default=None,
                   help="restart the engine (empty host tier) after this round (default rounds/2; 0 = never)")
    p.add_argument("--seed", type=int, default=0, help="seed of the conversation's tokens")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--config", help="store config (YAML/JSON path); default: the embedded default")
    where.add_argument("--cache-dir", help="use the embedded default layout under this directory")
    p.add_argument("--json", metavar="PATH", help="also write per-round results as JSON")


def _open_store(args):
    import tierstore
    if args.cache_dir:
        from tierstore.config import default_config
        return tierstore.open(default_config(args.cache_dir))
    return tierstore.open(args.config)


def _tiers(tiers: dict[str | None, int]) -> str:
    if not tiers:
        return "-"
    return "+".join(f"{name}" if len(tiers) == 1 else f"{name}:{n}" for name, n in tiers.items())


def run(args) -> int:
    from tierstore import KVCacheStore, KVNamespace
    from tierstore.models import RECOMPUTE_TOLERANCE, TinyConfig, TinyDecoder, TinyEngine

    if min(args.rounds, args.system_tokens, args.user_tokens, args.chunk_tokens) < 1 or args.answer_tokens < 0:
        raise SystemExit("tierstore demo: --rounds, --*-tokens must be positive")
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
    store = _open_store(args)
    print(f"tierstore demo: {cfg.name} ({cfg.num_hidden_layers} layers, {cfg.num_attention_heads} heads / "
          f"{cfg.num_key_value_heads} KV heads, {args.dtype}, random weights), "
          f"{cfg.kv_bytes_per_token(dtype) / 1024:.0f} KiB of KV per token")
    print(f"store: {' > '.join(t.name for t in store.tiers)}, chunks of {args.chunk_tokens} tokens; "
          f"logits checked bit-identical to the no-store split and within {tol:g} of a full recompute")
    header = (f"{'round':>5} {'prompt':>7} {'cached':>7}  {'from tier':<12} {'w/ cache':>9} {'recompute':>10} "
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
            print(f"{r:>5} {res.prompt_tokens:>7} {res.cached_tokens:>7}  {_tiers(res.tiers):<12} "
                  f"{res.ttft_s * 1e3:>7.1f}ms {recompute_s * 1e3:>8.1f}ms {recompute_s / res.ttft_s:>7.1f}×  "
                  f"{mark(exact) if hit else '-':^9} {mark(close):^8} {diff:>8.1e}", flush=True)
            if r == restart and r < args.rounds:
                store.close()
                store = _open_store(args)
                engine = TinyEngine(model, KVCacheStore(store, ns, chunk_tokens=args.chunk_tokens))
                print(f"{'':>5} -- engine restarted: host tier empty, disk tier reopened from its files --")
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
    print("-" * len(header))
    print(f"{'✓' if ok else '✗'} {len(rows)} rounds: {cached_tok}/{prompt_tok} prompt tokens served from the "
          f"cache ({cached_tok / prompt_tok:.0%}); prefill {with_cache:.2f}s with the cache vs {recompute:.2f}s "
          f"recompute ({recompute / with_cache:.1f}× faster); logits bit-identical {n_exact}/{len(checked)}, "
          f"within {tol:g} of recompute {n_close}/{len(rows)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": rows, "tolerance": tol, "dtype": args.dtype, "ok": ok}, f, indent=2)
    return 0 if ok else 1
