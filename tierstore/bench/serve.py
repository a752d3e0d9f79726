"""``tierstore bench serve``: multi-round QA against any OpenAI-compatible endpoint, TTFT per round and per QPS.

The workload has the shape of LMCache's ``synthetic-multi-round-qa``: ``users`` conversations share one
system prompt; each has its own history; every round appends a short question, streams the answer (at
most ``answer_tokens``) and keeps it in the history, so round N+1's prompt holds round N's. A user's next
round starts when its previous one ended; new rounds are released at ``qps`` requests per second (a sweep
runs each value in turn on fresh conversations). TTFT is the time from sending a request to its first
streamed token.

Each request is a streamed ``/v1/completions`` call (temperature 0); the prompt is plain text of random
words from a fixed vocabulary, so any model and tokenizer serve it. With ``--metrics-url`` (an engine's
``/metrics``, once per engine) the token hit rate per tier is read from ``tierstore_kv_lookup_tokens_total``
and ``tierstore_kv_hit_tokens_total`` before and after each QPS step, and vLLM's own prefix-cache hit rate
from ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total``.

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
  tierstore tier, its endpoint in ``S3_ENDPOINT``). Launched together they get a table of their own: TTFT of
  rounds 2+ and of the other instance's prefix, chunk hit rates per tier, answers compared, bytes stored.

``--repeats N`` runs the configurations N times in alternation (fresh tiers each time), so the machine's load
falls on all of them alike; each configuration's figures pool its repeats.

With ``--prefixes N`` the workload is vLLM's ``prefix_repetition`` dataset instead: ``N`` shared prefixes of
``--system-words`` words, and ``--users`` × ``--rounds`` independent requests released at ``qps``, each one of
the prefixes (seeded, the same order in every configuration) and a fresh ``--question-words`` suffix. A
request's "round" is then how many times its prefix was asked so far: round 1 is a prefix's first (cold)
request, ``2+`` its repeats — what a KV cache behind the engines is for.

Without ``--model`` a random-weight Llama is built (``--layers``, ``--hidden``) so that prefill costs what
a real model's does per token on this CPU; ``--kv-space`` (``VLLM_CPU_KVCACHE_SPACE``, GiB) sizes the
engines' own KV cache below the working set, where offload starts to matter.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import re
import statistics
import sys
import threading
import time
import urllib.request
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

WORDS = ("tier", "cache", "shard", "page", "block", "layer", "token", "prefix", "store", "host", "disk", "remote",
         "flush", "evict", "promote", "write", "read", "model", "chunk", "key", "value", "batch", "queue", "engine",
         "router", "round", "user", "answer", "system", "prompt", "history")
#: --launch configurations: launch.sh settings and extra engine arguments
CONFIGS = {
    "recompute": ({"KV": "none", "SHARED": "none"}, "--no-enable-prefix-caching"),
    "prefix-cache": ({"KV": "none", "SHARED": "none"}, ""),
    "tierstore": ({"KV": "tierstore", "SHARED": "none"}, ""),
    "tierstore-shared": ({"KV": "tierstore", "SHARED": "file://{workdir}/shared"}, ""),
    "tierstore-kv-aware": ({"KV": "tierstore", "SHARED": "none", "ROUTER_POLICY": "kv_aware"}, ""),
    "tierstore-serve": ({"KV": "tierstore-serve", "SHARED": "none"}, ""),
    "tierstore-serve-whole": ({"KV": "tierstore-serve", "SHARED": "none",
                               "CONNECTOR_OPTIONS": '"layerwise":false'}, ""),  # loads not overlapped
    "lmcache-mp": ({"KV": "lmcache-mp", "SHARED": "none"}, ""),
    "vllm-fs-tier": ({"KV": "vllm-fs-tier", "SHARED": "file://{workdir}/shared"}, ""),
    "tierstore-tier": ({"KV": "tierstore-tier", "SHARED": "file://{workdir}/shared"}, ""),
}
#: the configurations of vLLM's offloading with a secondary tier: (vLLM's, ours)
TIER_CONFIGS = ("vllm-fs-tier", "tierstore-tier")
HIT_FAMILIES = ("tierstore_kv_lookup_tokens_total", "tierstore_kv_hit_tokens_total",
                "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                "vllm:kv_offload_tiering_chunk_queries_total", "vllm:kv_offload_tiering_chunk_hits_total")


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
                                                           "in alternation (default 1)")
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


@dataclass(frozen=True)
class Workload:
    users: int = 4
    rounds: int = 4
    system_words: int = 1000
    history_words: int = 1000
    question_words: int = 50
    answer_tokens: int = 32
    seed: int = 0
    #: > 0: prefix repetition (module docstring) over this many shared prefixes of ``system_words`` words
    prefixes: int = 0

    def __post_init__(self) -> None:
        for name in ("users", "rounds", "answer_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        for name in ("system_words", "history_words", "question_words", "prefixes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative")

    def _words(self, n: int, *tag: object) -> str:
        rng = random.Random(repr((self.seed, *tag)))
        return " ".join(rng.choice(WORDS) for _ in range(n))

    def system(self, sweep: int) -> str:
        """The system prompt every user of sweep step ``sweep`` shares (a new one per step: no step warms
        the next)."""
        return f"System {sweep}: " + self._words(self.system_words, "system", sweep)

    def opening(self, sweep: int, user: int) -> str:
        return f"\n\nUser {user} history: " + self._words(self.history_words, "history", sweep, user)

    def question(self, sweep: int, user: int, round_: int) -> str:
        return f"\n\nQuestion {round_}: " + self._words(self.question_words, "question", sweep, user, round_) + \
            "\nAnswer:"


    def prefix_requests(self, sweep: int) -> list[tuple[int, int, str]]:
        """Prefix repetition: ``(prefix, its occurrence so far (1 = first), prompt)`` per request, in order."""
        rng = random.Random(repr((self.seed, "order", sweep)))
        seen: dict[int, int] = defaultdict(int)
        out = []
        for j in range(self.users * self.rounds):
            p = rng.randrange(self.prefixes)
            seen[p] += 1
            prompt = (f"Prefix {sweep}.{p}: " + self._words(self.system_words, "prefix", sweep, p)
                      + f"\n\nRequest {j}: " + self._words(self.question_words, "suffix", sweep, j) + "\nAnswer:")
            out.append((p, seen[p], prompt))
        return out


@dataclass
class Record:
    """One request: who sent it, when, and what came back."""

    qps: float
    user: int
    round: int
    start: float
    ttft_s: float | None = None
    latency_s: float | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    text: str = ""
    error: str | None = None


def stream_completion(url: str, model: str, prompt: str, max_tokens: int, timeout: float) -> tuple[
        float | None, float, str, dict[str, Any]]:
    """One streamed completion: ``(ttft seconds or None if no token came, total seconds, text, usage)``."""
    u = urlparse(url)
    conn_cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    conn = conn_cls(u.hostname or "127.0.0.1", u.port, timeout=timeout)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}})
    start = time.perf_counter()
    ttft, parts, usage = None, [], {}
    try:
        conn.request("POST", u.path.rstrip("/") + "/v1/completions", body=body,
                     headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read(500).decode(errors='replace')}")
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            event = json.loads(data)
            for choice in event.get("choices") or []:
                if choice.get("text"):
                    if ttft is None:
                        ttft = time.perf_counter() - start
                    parts.append(choice["text"])
            if event.get("usage"):
                usage = event["usage"]
    finally:
        conn.close()
    return ttft, time.perf_counter() - start, "".join(parts), usage


def ask(url: str, model: str, prompt: str, max_tokens: int, timeout: float, rec: Record) -> Record:
    """One streamed request, its outcome filled into ``rec`` (a failed request is a record, not a failed bench)."""
    try:
        rec.ttft_s, rec.latency_s, rec.text, usage = stream_completion(url, model, prompt, max_tokens, timeout)
        rec.prompt_tokens, rec.output_tokens = usage.get("prompt_tokens"), usage.get("completion_tokens")
    except Exception as exc:  # noqa: BLE001 - recorded
        rec.error = f"{type(exc).__name__}: {exc}"
    return rec


def run_prefix_step(url: str, model: str, w: Workload, qps: float, sweep: int, timeout: float) -> list[Record]:
    """The prefix-repetition requests at ``qps`` (each released on time, whatever is still running)."""
    records: list[Record] = []
    lock = threading.Lock()

    def one(prefix: int, nth: int, prompt: str) -> None:
        rec = ask(url, model, prompt, w.answer_tokens, timeout, Record(qps, prefix, nth, time.time()))
        with lock:
            records.append(rec)

    threads = []
    t0 = time.perf_counter()
    for j, request in enumerate(w.prefix_requests(sweep)):
        time.sleep(max(0.0, t0 + j / qps - time.perf_counter()))
        th = threading.Thread(target=one, args=request, daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    return records


def run_step(url: str, model: str, w: Workload, qps: float, sweep: int, timeout: float) -> list[Record]:
    """Every user's rounds at ``qps``: a round is released when its user's previous one has ended and the
    rate allows; returns the records in completion order. (With ``w.prefixes``: :func:`run_prefix_step`.)"""
    if qps <= 0:
        raise ValueError("qps must be positive")
    if w.prefixes:
        return run_prefix_step(url, model, w, qps, sweep, timeout)
    history = {u: w.system(sweep) + w.opening(sweep, u) for u in range(w.users)}
    next_round = dict.fromkeys(range(w.users), 1)
    ready = list(range(w.users))
    records: list[Record] = []
    cond = threading.Condition()

    def one(user: int, round_: int) -> None:
        prompt = history[user] + w.question(sweep, user, round_)
        rec = ask(url, model, prompt, w.answer_tokens, timeout, Record(qps, user, round_, time.time()))
        with cond:
            history[user] = prompt + rec.text
            records.append(rec)
            if round_ < w.rounds:
                next_round[user] = round_ + 1
                ready.append(user)
            cond.notify_all()

    threads = []
    total = w.users * w.rounds
    released = 0
    t0 = time.perf_counter()
    while released < total:
        with cond:
            while not ready:
                cond.wait()
            user = ready.pop(0)
        due = t0 + released / qps
        time.sleep(max(0.0, due - time.perf_counter()))
        th = threading.Thread(target=one, args=(user, next_round[user]), daemon=True)
        th.start()
        threads.append(th)
        released += 1
    for th in threads:
        th.join()
    return records


def scrape(urls: list[str]) -> dict[str, dict[str, float]]:
    """``{family: {labels: value}}`` of :data:`HIT_FAMILIES`, summed over the engines at ``urls``."""
    out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for url in urls:
        with urllib.request.urlopen(url, timeout=30) as r:
            text = r.read().decode()
        for family in HIT_FAMILIES:
            for m in re.finditer(rf"^{re.escape(family)}(\{{[^}}]*\}})? ([0-9.e+-]+)$", text, re.M):
                tier = re.search(r'tier="([^"]*)"', m.group(1) or "")
                out[family][tier.group(1) if tier else ""] += float(m.group(2))
    return {f: dict(v) for f, v in out.items()}


def hit_rates(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, float]:
    """Token hit rate per tier (tierstore) and vLLM's prefix-cache hit rate over an interval."""

    def delta(family: str) -> dict[str, float]:
        a, b = after.get(family, {}), before.get(family, {})
        return {k: a[k] - b.get(k, 0.0) for k in a}

    out: dict[str, float] = {}
    looked = sum(delta("tierstore_kv_lookup_tokens_total").values())
    if looked:
        out.update({f"tierstore {tier}": n / looked for tier, n in delta("tierstore_kv_hit_tokens_total").items()})
    queries = sum(delta("vllm:prefix_cache_queries_total").values())
    if queries:
        out["vllm prefix cache"] = sum(delta("vllm:prefix_cache_hits_total").values()) / queries
    chunk_hits = delta("vllm:kv_offload_tiering_chunk_hits_total")
    for tier, n in delta("vllm:kv_offload_tiering_chunk_queries_total").items():
        if n:  # vLLM's offloading tiers ("0:primary", "1:fs" ...): chunks found of chunks looked up
            out[f"offload {tier}"] = chunk_hits.get(tier, 0.0) / n
    return out


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-quantile (0..1) by linear interpolation; None for no values."""
    if not values:
        return None
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo, hi = int(pos), min(int(pos) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(records: list[Record]) -> list[dict[str, Any]]:
    """Per QPS and round (and ``2+``: every round after the first): count, errors, TTFT P50/P90/P99."""
    rows = []
    for qps in sorted({r.qps for r in records}):
        step = [r for r in records if r.qps == qps]
        groups: dict[str, list[Record]] = {str(n): [r for r in step if r.round == n]
                                           for n in sorted({r.round for r in step})}
        groups["2+"] = [r for r in step if r.round >= 2]
        for name, group in groups.items():
            ttfts = [r.ttft_s for r in group if r.ttft_s is not None and r.error is None]
            rows.append({"qps": qps, "round": name, "requests": len(group),
                         "errors": sum(r.error is not None for r in group),
                         "p50": percentile(ttfts, 0.5), "p90": percentile(ttfts, 0.9), "p99": percentile(ttfts, 0.99)})
    return rows


@dataclass
class Result:
    workload: Workload
    url: str
    model: str
    records: list[Record] = field(default_factory=list)
    hit_rates: dict[float, dict[str, float]] = field(default_factory=dict)
    #: TTFTs on one instance of prompts whose long prefix only the other instance computed (--launch)
    cross: list[float] = field(default_factory=list)
    #: bytes in the shared ``file://`` tier's directory after the run, per repeat (--launch)
    stored_bytes: list[int] = field(default_factory=list)
    repeats: int = 1

    def to_json(self) -> dict[str, Any]:
        return {"workload": asdict(self.workload), "url": self.url, "model": self.model,
                "summary": summarize(self.records), "hit_rates": {str(k): v for k, v in self.hit_rates.items()},
                "cross_instance_ttft_s": self.cross, "stored_bytes": self.stored_bytes,
                "records": [asdict(r) for r in self.records]}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Result:
        return cls(Workload(**d["workload"]), d["url"], d["model"], [Record(**r) for r in d["records"]],
                   {float(k): v for k, v in d.get("hit_rates", {}).items()}, list(d.get("cross_instance_ttft_s", [])),
                   list(d.get("stored_bytes", [])))

    def pool(self, other: Result) -> None:
        """Add a repeat's figures: its requests, probes and stored bytes; hit rates averaged over repeats."""
        self.repeats += 1
        n = self.repeats
        self.records += other.records
        self.cross += other.cross
        self.stored_bytes += other.stored_bytes
        for rate, rates in other.hit_rates.items():
            mine = self.hit_rates.setdefault(rate, {})
            for k in set(mine) | set(rates):
                mine[k] = ((n - 1) * mine.get(k, 0.0) + rates.get(k, 0.0)) / n


def measure(url: str, model: str, w: Workload, qps: Sequence[float], metrics_urls: Sequence[str] = (),
            timeout: float = 600.0) -> Result:
    res = Result(w, url, model)
    for i, rate in enumerate(qps):
        before = scrape(list(metrics_urls)) if metrics_urls else {}
        res.records += run_step(url, model, w, rate, i, timeout)
        if metrics_urls:
            res.hit_rates[rate] = hit_rates(before, scrape(list(metrics_urls)))
    return res


def cross_instance(first: str, second: str, model: str, w: Workload, probes: int = 3, settle_s: float = 5.0,
                   timeout: float = 600.0) -> list[float]:
    """TTFT on ``second`` of prompts whose long prefix (a system prompt and a history of the workload's
    sizes — a prefix's, for prefix repetition — fresh words each time) only ``first`` computed, ``settle_s``
    after it did (write-back time)."""
    out = []
    for i in range(probes):
        prefix = f"Cross {i}: " + w._words(w.system_words + (0 if w.prefixes else w.history_words), "cross", i)
        stream_completion(first, model, prefix + "\n\nQuestion A:", w.answer_tokens, timeout)
        time.sleep(settle_s)
        ttft, _, _, _ = stream_completion(second, model, prefix + "\n\nQuestion B:", w.answer_tokens, timeout)
        if ttft is not None:
            out.append(ttft)
    return out


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{1e3 * v:.0f}"


def round_p50(res: Result, round_: str) -> float | None:
    """The median over QPS steps of the TTFT P50 of ``round_`` (``"1"``, ``"2"``, ... or ``"2+"``)."""
    vals = [r["p50"] for r in summarize(res.records) if r["round"] == round_ and r["p50"] is not None]
    return statistics.median(vals) if vals else None


def answers(res: Result) -> dict[tuple[float, int, int], str]:
    """Each answered request's text by ``(qps, user, round)``."""
    return {(r.qps, r.user, r.round): r.text for r in res.records if r.error is None}


def table(res: Result) -> str:
    lines = ["| QPS | round | requests | errors | TTFT P50 ms | P90 ms | P99 ms |", "|---|---|---|---|---|---|---|"]
    for r in summarize(res.records):
        lines.append(f"| {r['qps']:g} | {r['round']} | {r['requests']} | {r['errors']} | {_ms(r['p50'])} | "
                     f"{_ms(r['p90'])} | {_ms(r['p99'])} |")
    for rate, rates in res.hit_rates.items():
        shown = ", ".join(f"{k} {100 * v:.1f}%" for k, v in sorted(rates.items())) or "no lookups"
        lines.append(f"\nQPS {rate:g}: token hit rate {shown}")
    return "\n".join(lines)


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
        lines.append(f"| {name} | {_ms(r1)} | {_ms(r2)} | {ratio(base.get('recompute'))} | "
                     f"{ratio(base.get('prefix-cache'))} | {_ms(c)} | {f'{c / c0:.2f}' if c and c0 else '-'} | "
                     f"{differ} | {sum(r.error is not None for r in res.records)} |")
    return "\n".join(lines)


def round_p90(res: Result, round_: str) -> float | None:
    vals = [r["p90"] for r in summarize(res.records) if r["round"] == round_ and r["p90"] is not None]
    return statistics.median(vals) if vals else None


def tier_table(results: Mapping[str, Result]) -> str:
    """vLLM's ``fs`` secondary tier against tierstore's (:data:`TIER_CONFIGS`): TTFT of rounds 2+ (P50, P90)
    and of the other instance's prefix (median), the ratios tierstore/fs (< 1: tierstore faster), the chunk
    hit rates of vLLM's offloading tiers, the answers of one that differ from the other's, bytes stored."""
    fs, ours = (results[n] for n in TIER_CONFIGS)
    theirs = answers(fs)
    lines = ["| secondary tier | TTFT P50 rounds 2+ ms | P90 ms | other instance's prefix ms | chunk hits | "
             "stored MiB | errors |", "|---|---|---|---|---|---|---|"]
    for name, res in zip(TIER_CONFIGS, (fs, ours), strict=True):
        cross = statistics.median(res.cross) if res.cross else None
        hits = ", ".join(f"{k.removeprefix('offload ')} {100 * statistics.mean(v):.0f}%" for k, v in sorted(
            _rates_by_key(res).items()) if k.startswith("offload ")) or "-"
        stored = f"{statistics.median(res.stored_bytes) / 2**20:.0f}" if res.stored_bytes else "-"
        lines.append(f"| {name} | {_ms(round_p50(res, '2+'))} | {_ms(round_p90(res, '2+'))} | {_ms(cross)} | {hits} | "
                     f"{stored} | {sum(r.error is not None for r in res.records)} |")

    def ratio(a: float | None, b: float | None) -> str:
        return f"{a / b:.2f}" if a and b else "-"
    compared = [(k, t) for k, t in answers(ours).items() if k in theirs]
    lines.append(f"\ntierstore/fs: TTFT P50 rounds 2+ {ratio(round_p50(ours, '2+'), round_p50(fs, '2+'))}, P90 "
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


def launch_names(args: argparse.Namespace) -> list[str]:
    """The configurations of ``--launch``, checked (``SystemExit`` naming what is wrong)."""
    names = [c.strip() for c in args.launch.split(",") if c.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or not names:
        raise SystemExit(f"--launch: unknown configuration(s) {unknown}; choose from {', '.join(CONFIGS)}")
    if len(set(names)) != len(names):
        raise SystemExit("--launch: a configuration is named twice (--repeats runs them again)")
    if args.repeats < 1:
        raise SystemExit("--repeats: at least 1")
    if args.shared is not None and not args.shared.startswith(("file://", "s3://")):
        raise SystemExit(f"--shared: a file:// or s3:// URL, got {args.shared!r}")
    if args.shared and args.shared.startswith("s3://") and "vllm-fs-tier" in names:
        raise SystemExit("--shared: vLLM's fs tier (vllm-fs-tier) needs a file:// directory, not S3")
    return names


def deployment_env(name: str, args: argparse.Namespace, model: str, state: Path) -> dict[str, str]:
    """``launch.sh``'s settings for configuration ``name`` with its state (and file:// tiers) under ``state``."""
    from ..sizes import parse_size
    from .deploy import CPU_ENGINE_ARGS

    settings, extra = CONFIGS[name]
    env = {k: v.format(workdir=state) for k, v in settings.items()}
    if args.shared is not None and env["SHARED"] != "none":
        env["SHARED"] = args.shared
    try:
        cpu_bytes = parse_size(args.cpu_bytes, key="--cpu-bytes")
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    env.update(MODEL=model, VLLM_CPU_KVCACHE_SPACE=str(args.kv_space), HOST_CAPACITY="4GiB",
               DISK_CAPACITY="16GiB", CPU_BYTES_TO_USE=str(cpu_bytes),
               ENGINE_ARGS=f"{CPU_ENGINE_ARGS} {args.engine_args} {extra}".strip())
    return env


def stored_bytes(shared: str) -> int | None:
    """The bytes of every file under a ``file://`` tier's directory (None for another URL)."""
    if not shared.startswith("file://"):
        return None
    root = Path(shared[len("file://"):])
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) if root.exists() else 0


def launch_and_measure(args: argparse.Namespace, w: Workload, rates: list[float]) -> dict[str, Result]:
    """Each configuration of ``--launch`` in turn on a fresh deployment, ``--repeats`` times in alternation;
    the results by name (the repeats pooled)."""
    import tempfile

    from .deploy import Deployment

    names = launch_names(args)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="tierstore-serve-"))
    model = args.model
    if model is None:
        from tierstore_vllm.bench import build_llama

        heads = max(1, args.hidden // 64)  # head_dim 64: what vLLM's CPU attention supports
        model = str(build_llama(workdir / "model", hidden=args.hidden, layers=args.layers, heads=heads,
                                kv_heads=heads, intermediate=3 * args.hidden))
    results: dict[str, Result] = {}
    for rep in range(args.repeats):
        for name in names:
            state = workdir / (name if rep == 0 else f"{name}.{rep}")  # fresh tiers each repeat
            env = deployment_env(name, args, model, state)
            print(f"  serve: {name}{f' (repeat {rep + 1})' if rep else ''}: starting two instances and the "
                  "router ...", flush=True)
            with Deployment(env, state) as dep:
                try:
                    res = measure(dep.url("router"), model, w, rates, [dep.url("a") + "/metrics",
                                                                       dep.url("b") + "/metrics"], args.timeout)
                    res.cross = cross_instance(dep.url("a"), dep.url("b"), model, w, timeout=args.timeout)
                except OSError as exc:  # an engine went away (its /metrics no longer answers)
                    raise SystemExit(f"{name}: {exc}\n{dep.logs()}") from None
            stored = stored_bytes(env["SHARED"])
            res.stored_bytes = [] if stored is None else [stored]
            print(table(res), flush=True)
            if name in results:
                results[name].pool(res)
            else:
                results[name] = res
    return results


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
        if all(n in results for n in TIER_CONFIGS):
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
