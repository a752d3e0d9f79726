"""``tierstore bench serve``: multi-round QA against any OpenAI-compatible endpoint, TTFT per round and per QPS.

The workload (LMCache's ``synthetic-multi-round-qa`` shape, or vLLM's ``prefix_repetition`` with ``--prefixes``) and
its statistics are :mod:`tierstore.bench.qa`'s; with ``--metrics-url`` (an engine's ``/metrics``, once per engine)
the token hit rates per tier and of vLLM's prefix cache are read before and after each QPS step.

With ``--launch CONFIGS`` it starts the guide's deployment itself for each configuration in turn
(``examples/deploy/launch.sh``: two API servers and ``vllm-router``, round robin), runs the same workload
against each and compares them: TTFT per round against recompute and against vLLM's prefix cache alone,
and whether every answer (temperature 0) equals the first configuration's. Configurations (vLLM's prefix
cache stays on except in ``recompute``):

* ``recompute``: no prefix cache of any kind;
* ``prefix-cache``: vLLM's own prefix cache only;
* ``tierstore``: + the TierstoreConnector, host and disk tiers per instance;
* ``tierstore-shared``: + a ``file://`` shared tier (an NFS mount's stand-in) behind both instances.
* ``tierstore-kv-aware``: ``tierstore`` behind ``vllm-router --policy kv_aware`` instead of round robin: the
  instances publish KV events (vLLM's blocks, and tierstore's saved chunks as medium CPU) and the router
  routes each request to where its prefix is;
* ``tierstore-serve``: + one ``tierstore serve`` for the node, its host and disk tiers used by both instances;
* ``lmcache-mp``: LMCache's multiprocess server instead (its ``LMCacheMPConnector``, host memory and a disk
  tier for the node; ``make lmcache-peer`` installs it).
* ``vllm-fs-tier`` and ``tierstore-tier``: vLLM's own offloading (``OffloadingConnector``, a CPU tier of
  ``--cpu-bytes``) with vLLM's ``fs`` secondary tier or tierstore's ``TierstoreTier``, both on one
  ``file://`` directory behind the two instances (``--shared`` puts them elsewhere: an ``s3://`` URL for the
  tierstore tier, its endpoint in ``S3_ENDPOINT``); ``tierstore-tier-once``: the same with the shared tier's
  ``verify_reads: once``. The fs tier launched with one of ours gets a table of their own: TTFT of rounds 2+
  and of the other instance's prefix, chunk hit rates per tier, answers compared, bytes stored.

``--repeats N`` runs the configurations N times in alternation (fresh tiers each time), every other repeat in
reverse order (A B, B A, ...), so the machine's load falls on all of them alike; each configuration's figures pool
its repeats.

Without ``--model`` a random-weight Llama is built (``--layers``, ``--hidden``) so that prefill costs what
a real model's does per token on this CPU; ``--kv-space`` (``VLLM_CPU_KVCACHE_SPACE``, GiB) sizes the
engines' own KV cache below the working set, where offload starts to matter.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from .qa import Result, Workload, measure, ms, summarize, table
from .serve_launch import CONFIGS, TIER_CONFIGS, launch_and_measure


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the OpenAI-compatible endpoint (a router)")
    p.add_argument("--model", default=None, help="the served model name (with --launch: the model to serve; "
                                                 "default a random Llama built under --workdir)")
    p.add_argument("--launch", default=None, metavar="CONFIGS",
                   help="start the deployment for each configuration in turn and compare them: comma-separated "
                        f"from {', '.join(CONFIGS)} (needs vLLM, vllm-router and the repository checkout)")
    p.add_argument("--workdir", default=None, help="with --launch: model, tiers and logs (default: a temp dir)")
    p.add_argument("--layers", type=int, default=16, help="with --launch, the built model's layers (default 16)")
    p.add_argument("--hidden", type=int, default=512, help="with --launch, the built model's width (default 512)")
    p.add_argument("--kv-space", default="1", help="with --launch: VLLM_CPU_KVCACHE_SPACE in GiB (default 1)")
    p.add_argument("--engine-args", default="--max-model-len 8192 --max-num-batched-tokens 8192",
                   help="with --launch: more arguments for every engine")
    p.add_argument("--prefixes", type=int, default=0,
                   help="prefix repetition (vLLM's prefix_repetition dataset) over this many shared prefixes of "
                        "--system-words words: --users x --rounds independent requests, each a prefix and a fresh "
                        "--question-words suffix (default 0: multi-round QA)")
    p.add_argument("--cpu-bytes", default="1GiB", help="with --launch: the CPU tier (cpu_bytes_to_use) of the "
                                                       "*-tier configurations (default 1GiB)")
    p.add_argument("--shared", default=None, metavar="URL",
                   help="with --launch: the shared tier of the configurations that have one (default a file:// "
                        "directory under --workdir)")
    p.add_argument("--repeats", type=int, default=1, help="with --launch: run the configurations this many times, "
                                                           "in alternation, every other time in reverse order "
                                                           "(default 1)")
    p.add_argument("--users", type=int, default=4, help="conversations (default 4)")
    p.add_argument("--rounds", type=int, default=4, help="rounds per conversation (default 4)")
    p.add_argument("--system-words", type=int, default=1000, help="shared system prompt, in words (default 1000)")
    p.add_argument("--history-words", type=int, default=1000, help="each user's own history (default 1000)")
    p.add_argument("--question-words", type=int, default=50, help="each round's question (default 50)")
    p.add_argument("--answer-tokens", type=int, default=32, help="max tokens per answer (default 32)")
    p.add_argument("--qps", default="0.5", help="comma-separated request rates to sweep (default 0.5)")
    p.add_argument("--metrics-url", action="append", default=[],
                   help="an engine's /metrics (repeat per engine): token hit rates per tier")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default 600)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write every request and the summary here")
    p.add_argument("--plot", default=None, help="with --launch: a PNG of TTFT P50 per round per configuration")


def round_p50(res: Result, round_: str) -> float | None:
    """The median over QPS steps of the TTFT P50 of ``round_`` (``"1"``, ``"2"``, ... or ``"2+"``)."""
    vals = [r["p50"] for r in summarize(res.records) if r["round"] == round_ and r["p50"] is not None]
    return statistics.median(vals) if vals else None


def answers(res: Result) -> dict[tuple[float, int, int], str]:
    """Each answered request's text by ``(qps, user, round)``."""
    return {(r.qps, r.user, r.round): r.text for r in res.records if r.error is None}


def compare(results: dict[str, Result]) -> str:
    """Per configuration: TTFT P50 of round 1 and of rounds 2+, the ratios to ``recompute`` and to
    ``prefix-cache`` (> 1: faster), and the answers that differ from the first configuration's."""
    first = answers(next(iter(results.values())))
    base = {name: round_p50(results[name], "2+") for name in ("recompute", "prefix-cache") if name in results}
    cross = {name: statistics.median(res.cross) if res.cross else None for name, res in results.items()}
    lines = ["| configuration | TTFT P50 round 1 ms | TTFT P50 rounds 2+ ms | vs recompute | vs prefix cache | "
             "other instance's prefix ms | ÷ recompute | answers differing | errors |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, res in results.items():
        r1, r2 = round_p50(res, "1"), round_p50(res, "2+")
        mine = answers(res)
        differ = sum(mine[k] != v for k, v in first.items() if k in mine)

        def ratio(b: float | None, r2: float | None = r2) -> str:
            return f"{b / r2:.2f}×" if b and r2 else "-"
        c, c0 = cross[name], cross.get("recompute")
        lines.append(f"| {name} | {ms(r1)} | {ms(r2)} | {ratio(base.get('recompute'))} | "
                     f"{ratio(base.get('prefix-cache'))} | {ms(c)} | {f'{c / c0:.2f}' if c and c0 else '-'} | "
                     f"{differ} | {sum(r.error is not None for r in res.records)} |")
    return "\n".join(lines)


def round_p90(res: Result, round_: str) -> float | None:
    vals = [r["p90"] for r in summarize(res.records) if r["round"] == round_ and r["p90"] is not None]
    return statistics.median(vals) if vals else None


def tier_table(results: Mapping[str, Result]) -> str:
    """vLLM's ``fs`` secondary tier against tierstore's (:data:`TIER_CONFIGS`): TTFT of rounds 2+ (P50, P90)
    and of the other instance's prefix (median), the ratios tierstore/fs (< 1: tierstore faster), the chunk
    hit rates of vLLM's offloading tiers, the answers of one that differ from the other's, bytes stored."""
    fs_name, *our_names = (n for n in TIER_CONFIGS if n in results)
    fs = results[fs_name]
    theirs = answers(fs)
    lines = ["| secondary tier | TTFT P50 rounds 2+ ms | P90 ms | other instance's prefix ms | chunk hits | "
             "stored MiB | errors |", "|---|---|---|---|---|---|---|"]
    for name in (fs_name, *our_names):
        res = results[name]
        cross = statistics.median(res.cross) if res.cross else None
        hits = ", ".join(f"{k.removeprefix('offload ')} {100 * statistics.mean(v):.0f}%" for k, v in sorted(
            _rates_by_key(res).items()) if k.startswith("offload ")) or "-"
        stored = f"{statistics.median(res.stored_bytes) / 2**20:.0f}" if res.stored_bytes else "-"
        lines.append(f"| {name} | {ms(round_p50(res, '2+'))} | {ms(round_p90(res, '2+'))} | {ms(cross)} | {hits} | "
                     f"{stored} | {sum(r.error is not None for r in res.records)} |")

    def ratio(a: float | None, b: float | None) -> str:
        return f"{a / b:.2f}" if a and b else "-"
    lines.append("")
    for name in our_names:
        ours = results[name]
        compared = [(k, t) for k, t in answers(ours).items() if k in theirs]
        lines.append(f"{name}/fs: TTFT P50 rounds 2+ {ratio(round_p50(ours, '2+'), round_p50(fs, '2+'))}, P90 "
                     f"{ratio(round_p90(ours, '2+'), round_p90(fs, '2+'))}, other instance's prefix "
                     f"{ratio(*(statistics.median(r.cross) if r.cross else None for r in (ours, fs)))}; answers "
                     f"differing: {sum(theirs[k] != t for k, t in compared)} of {len(compared)}")
    return "\n".join(lines)


def _rates_by_key(res: Result) -> dict[str, list[float]]:
    out: dict[str, list[float]] = defaultdict(list)
    for rates in res.hit_rates.values():
        for k, v in rates.items():
            out[k].append(v)
    return out


def deployment_targets(results: Mapping[str, Result]) -> list[tuple[str, str, float, float]]:
    """Issue 22's targets as ``(what, measured, ratio, target)`` rows (ratio ≥ target: met), each for the best
    tierstore configuration of ``results`` (those of a launch with ``recompute`` and ``prefix-cache``)."""
    ours = {n: r for n, r in results.items() if n.startswith("tierstore")}
    base = {n: round_p50(results[n], "2+") for n in ("recompute", "prefix-cache") if n in results}
    rows: list[tuple[str, str, float, float]] = []
    medians = {n: m for n, r in ours.items() if (m := round_p50(r, "2+")) is not None}
    if medians:
        mine, t = min(medians.items(), key=lambda kv: kv[1])
        for name, want in (("recompute", 3.0), ("prefix-cache", 1.5)):
            b = base.get(name)
            if b:
                rows.append((f"TTFT P50 rounds 2+ ({mine}) vs {name}", f"{1e3 * t:.0f} ms vs {1e3 * b:.0f} ms",
                             b / t, want))
    recompute = results.get("recompute")
    cross = {n: statistics.median(r.cross) for n, r in ours.items() if r.cross}
    if cross and recompute is not None and recompute.cross:
        c0 = statistics.median(recompute.cross)
        name, c = min(cross.items(), key=lambda kv: kv[1])
        rows.append((f"other instance's prefix ({name}) ≤ 0.5× recompute", f"{1e3 * c:.0f} ms vs {1e3 * c0:.0f} ms",
                     0.5 * c0 / c, 1.0))
    first = answers(next(iter(results.values())))
    others = [(k, text) for res in list(results.values())[1:] for k, text in answers(res).items() if k in first]
    if others:
        same = sum(first[k] == text for k, text in others)
        rows.append(("answers equal to the first configuration's (temperature 0)",
                     f"{len(others) - same} of {len(others)} differ", same / len(others), 1.0))
    return rows


def plot(summaries: Mapping[str, Sequence[Mapping[str, Any]]], path: str) -> bool:
    """TTFT P50 per round (bars) for each configuration, from each one's :func:`summarize` rows; whether
    it was written (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = list(summaries)
    rounds = sorted({r["round"] for rows in summaries.values() for r in rows if r["round"] != "2+"}, key=int)
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        by_round = {r["round"]: r["p50"] for r in summaries[name]}
        ax.bar([j + i * width for j in range(len(rounds))], [by_round.get(n) or 0 for n in rounds], width,
               label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rounds))], [f"round {n}" for n in rounds])
    ax.set_ylabel("TTFT P50 (s)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def run(args: argparse.Namespace) -> int:
    try:
        rates = [float(q) for q in args.qps.split(",") if q.strip()]
    except ValueError:
        raise SystemExit(f"--qps: expected comma-separated numbers, got {args.qps!r}") from None
    if not rates or any(q <= 0 for q in rates):
        raise SystemExit("--qps: give one or more positive rates")
    try:
        w = Workload(args.users, args.rounds, args.system_words, args.history_words, args.question_words,
                     args.answer_tokens, args.seed, args.prefixes)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if args.launch:
        results = launch_and_measure(args, w, rates)
        print("\n" + compare(results))
        if TIER_CONFIGS[0] in results and any(n in results for n in TIER_CONFIGS[1:]):
            print("\n" + tier_table(results))
        if args.plot and not plot({n: summarize(r.records) for n, r in results.items()}, args.plot):
            print("--plot: matplotlib is not installed; no plot written")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"command": "tierstore bench serve " + " ".join(sys.argv[3:] if sys.argv[1:3] == [
                    "bench", "serve"] else sys.argv[1:]), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                           "configurations": {name: r.to_json() for name, r in results.items()}}, f, indent=2)
        return 1 if any(r.error for res in results.values() for r in res.records) else 0
    if args.model is None:
        raise SystemExit("--model: the served model name is needed (or --launch to start a deployment)")
    res = measure(args.url, args.model, w, rates, args.metrics_url, args.timeout)
    print(table(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res.to_json(), f, indent=2)
    errors = sum(r.error is not None for r in res.records)
    if errors:
        first = next(r.error for r in res.records if r.error)
        print(f"\n{errors} request(s) failed; the first: {first}")
    return 1 if errors else 0
