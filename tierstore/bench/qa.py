"""The multi-round QA workload of ``tierstore bench serve``, against any OpenAI-compatible endpoint: TTFT per
round and per QPS.

The workload has the shape of LMCache's ``synthetic-multi-round-qa``: ``users`` conversations share one
system prompt; each has its own history; every round appends a short question, streams the answer (at
most ``answer_tokens``) and keeps it in the history, so round N+1's prompt holds round N's. A user's next
round starts when its previous one ended; new rounds are released at ``qps`` requests per second (a sweep
runs each value in turn on fresh conversations). TTFT is the time from sending a request to its first
streamed token.

Each request is a streamed ``/v1/completions`` call (temperature 0); the prompt is plain text of random
words from a fixed vocabulary, so any model and tokenizer serve it. With metrics URLs (an engine's
``/metrics``, once per engine) the token hit rate per tier is read from ``tierstore_kv_lookup_tokens_total``
and ``tierstore_kv_hit_tokens_total`` before and after each QPS step, and vLLM's own prefix-cache hit rate
from ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total``.

With ``prefixes`` the workload is vLLM's ``prefix_repetition`` dataset instead: ``prefixes`` shared prefixes of
``system_words`` words, and ``users`` × ``rounds`` independent requests released at ``qps``, each one of the
prefixes (seeded, the same order in every configuration) and a fresh ``question_words`` suffix. A request's
"round" is then how many times its prefix was asked so far: round 1 is a prefix's first (cold) request,
``2+`` its repeats — what a KV cache behind the engines is for.
"""

from __future__ import annotations

import http.client
import json
import random
import re
import threading
import time
import urllib.request
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlparse

WORDS = ("tier", "cache", "shard", "page", "block", "layer", "token", "prefix", "store", "host", "disk", "remote",
         "flush", "evict", "promote", "write", "read", "model", "chunk", "key", "value", "batch", "queue", "engine",
         "router", "round", "user", "answer", "system", "prompt", "history")
HIT_FAMILIES = ("tierstore_kv_lookup_tokens_total", "tierstore_kv_hit_tokens_total",
                "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                "vllm:kv_offload_tiering_chunk_queries_total", "vllm:kv_offload_tiering_chunk_hits_total")


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


def ms(v: float | None) -> str:
    return "-" if v is None else f"{1e3 * v:.0f}"


def table(res: Result) -> str:
    lines = ["| QPS | round | requests | errors | TTFT P50 ms | P90 ms | P99 ms |", "|---|---|---|---|---|---|---|"]
    for r in summarize(res.records):
        lines.append(f"| {r['qps']:g} | {r['round']} | {r['requests']} | {r['errors']} | {ms(r['p50'])} | "
                     f"{ms(r['p90'])} | {ms(r['p99'])} |")
    for rate, rates in res.hit_rates.items():
        shown = ", ".join(f"{k} {100 * v:.1f}%" for k, v in sorted(rates.items())) or "no lookups"
        lines.append(f"\nQPS {rate:g}: token hit rate {shown}")
    return "\n".join(lines)
