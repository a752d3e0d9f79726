"""Write ``BENCHMARKS.md`` and its PNG plots from the results of ``tierstore bench all``.

Every figure stands beside its limit or peer from the same run (the ratio column), the machine and the
date head the file, and each target of issue 9 is listed with the measured value. The plots need
matplotlib (the ``bench`` and ``test`` extras); without it the Markdown is still written.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from typing import Any

from ..sizes import format_size

#: ``bench serve --launch --json`` output and its ``--plot``, read from the report's folder when there
DEPLOYMENT, DEPLOYMENT_PLOT = "serve.json", "serve_ttft.png"
TIER_SERIES = [  # (label, key, limit key): each tier operation and the limit it is drawn against
    ("host get(out=)", "host_get", "memcpy"),
    ("disk get(out=)", "disk_get", "page_cache_read"),
    ("disk put", "disk_put", "plain_write"),
]
LIMIT_LABELS = {"memcpy": "memcpy (copy_, 1 thread)", "page_cache_read": "page-cache readinto",
                "plain_write": "plain write, no fsync, same folders and threads"}


def md_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}×"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _tiers(rows: list[dict[str, Any]]) -> str:
    body = []
    for r in rows:
        for label, key, limit in TIER_SERIES:
            body.append([format_size(r["size"]), label, f"{r[key]:.2f}", LIMIT_LABELS[limit], f"{r[limit]:.2f}",
                         _x(_ratio(r[key], r[limit]))])
    return md_table(["object", "operation", "GB/s", "limit", "limit GB/s", "ratio"], body)


def _remote(r: dict[str, Any]) -> str:
    body = [[f"concurrent ceiling ({r['concurrency']} threads, plain GETs)", f"{r['ceiling']:.3f}", "1.00×"],
            ["model ceiling (waves × (latency + size/bandwidth))", f"{r['model_ceiling']:.3f}",
             _x(_ratio(r["model_ceiling"], r["ceiling"]))],
            ["one plain stream (sequential GETs)", f"{r['single_stream']:.3f}", _x(_ratio(r["single_stream"],
                                                                                       r["ceiling"]))],
            ["tierstore store get(out=) (batched where the store has it)", f"{r['get']:.3f}",
             _x(_ratio(r["get"], r["ceiling"]))],
            ["tierstore remote backend read_many (the tier's storage alone, fresh tensors)",
             f"{r['tier_get_many']:.3f}",
             _x(_ratio(r["tier_get_many"], r["ceiling"]))],
            ["tierstore remote get(out=), one key per call", f"{r['get_loop']:.3f}",
             _x(_ratio(r["get_loop"], r["ceiling"]))],
            ["tierstore remote put", f"{r['put']:.3f}", "-"]]
    text = md_table(["measurement", "GB/s", "vs ceiling"], body)
    return text + ("\n\n" + _cold(r["cold"]) if "cold" in r else "")


#: rows of the cold-instance table: (label, measurement, ceiling or None, round trips counted spaced)
COLD_ROWS = [("`lookup` (client started, connections open)", "lookup", "head_ceiling", "lookup_spaced"),
             ("first `lookup` after `open` (client start-up included)", "first_lookup", "head_ceiling", None),
             ("`get_many` of the keys, none indexed", "load", "get_ceiling", "load_spaced"),
             ("`lookup`, then `get_many` (scheduler, then worker)", "lookup_load", None, None),
             ("`open` + `lookup`, prefix listed at open (`list_on_open`; a LIST is a GET)", "listed", None, None),
             ("ceiling: plain HEADs, same concurrency", "head_ceiling", None, None),
             ("ceiling: plain GETs (one each), same concurrency", "get_ceiling", None, None)]


def _requests(m: dict[str, Any]) -> str:
    return " + ".join(f"{n} {method}" for method, n in sorted(m["requests"].items())) or "0"


def _cold(c: dict[str, Any]) -> str:
    """The cold-instance table (:mod:`tierstore.bench.cold`): ms, requests and round trips per step."""
    body = []
    for label, key, ceiling, spaced in COLD_ROWS:
        m = c[key]
        trips = f"{c[spaced]['round_trips']}" if spaced else "-"
        vs = _x(_ratio(c[ceiling]["s"], m["s"])) if ceiling else "-"
        body.append([label, f"{1e3 * m['s']:.0f}", _requests(m), trips, vs])
    return (f"Cold instance: {c['count']} chunks of {format_size(c['size'])} only on S3, a fresh store "
            f"(empty host tier, remote not listed) with `max_in_flight` {c['in_flight']} (the remote tier's "
            f"default); medians of {c['repeats']}, requests counted at the shim. Round trips are latencies "
            "waited in sequence, "
            f"counted with every answer {1e3 * c['round_trip_delay_s']:.0f} ms late so that CPU queuing cannot "
            "split a wave. The ceilings are plain s3fs requests at the same concurrency in the same run; "
            "`vs ceiling` > 1 is faster than it.\n\n"
            + md_table(["cold instance", "ms", "requests", "round trips", "vs ceiling"], body))


def _kv(kv: dict[str, Any]) -> str:
    scen = kv["scenarios"]
    base = next((s["ttft_s"]["p50"] for s in scen if s["scenario"] == "none"), None)
    body = [[s["scenario"], str(s["requests"]), f"{100 * s['hit_rate']:.0f}%"]
            + [f"{1e3 * s['ttft_s'][k]:.1f}" for k in ("p50", "p90", "p99")]
            + [_x(_ratio(base, s["ttft_s"]["p50"]))] for s in scen]
    m = kv["meta"]
    text = (f"{m['sessions']} sessions × {m['rounds']} rounds at {m['qps']:g} QPS, chunks of {m['chunk_tokens']} "
            f"tokens, working set {format_size(m['working_set_bytes'])}, host tier "
            f"{format_size(m['host_capacity_bytes'])}.\n\n")
    text += md_table(["configuration", "requests", "hit rate", "TTFT P50 ms", "P90 ms", "P99 ms", "P50 vs none"],
                     body)
    if kv.get("chunk_costs"):
        rows = [[str(c["chunk_tokens"]), format_size(c["chunk_bytes"]), f"{1e3 * c['prefill_s']:.2f}"]
                + [f"{1e3 * c[f'{t}_load_s']:.2f}" for t in ("host", "disk", "remote")] for c in kv["chunk_costs"]]
        text += "\n\nOne chunk: load from each tier vs recompute it (prefill), best of 7, ms:\n\n"
        text += md_table(["chunk tokens", "KV bytes", "prefill", "load host", "load disk", "load remote"], rows)
    if kv.get("paged_load"):
        rows = [[r["tier"], r["path"], f"{1e3 * r['kv_ready_s']:.1f}", f"{1e3 * r['first_layer_s']:.1f}",
                 f"{1e3 * r['ttft_s']:.1f}", _x(r["speedup"])] for r in kv["paged_load"]]
        text += (f"\n\nThe KV of a cached {m.get('paged_tokens', '?')}-token prompt into a paged cache (vLLM layout, "
                 f"block size 16), median of {m.get('paged_repeats', '?')}: `load` + `scatter_layers` (the old path), "
                 "`load_into` straight into the blocks, and layer-wise `load_into` over per-layer objects. TTFT adds "
                 "the last token's compute to the time the KV is in; layer-wise the model runs each layer as soon as "
                 "its KV is in, so compute and loading share the CPU:\n\n")
        text += md_table(["tier", "path", "KV in ms", "layer 0 usable ms", "TTFT ms", "TTFT vs load+scatter"], rows)
    return text


def _control(rows: list[dict[str, Any]]) -> str:
    body = [[f"{r['keys']:,}", f"{r['lookup_us_per_key']:.3f}", _x(_ratio(2.0, r["lookup_us_per_key"])),
             f"{r['index_bytes_per_key']:.0f}", _x(_ratio(200.0, r["index_bytes_per_key"]))] for r in rows]
    return md_table(["keys in the index", "lookup µs/key", "vs 2 µs target", "index bytes/key",
                     "vs 200 B target"], body)


def _weights(w: dict[str, Any]) -> str:
    memcpy = w["limits"].get("memcpy")
    body = [[r["scenario"], r["method"], "-" if r["gbps"] is None else f"{r['gbps']:.2f}",
             _x(_ratio(r["gbps"], memcpy)), r.get("note", "")] for r in w["rows"]]
    return (f"Checkpoint {format_size(w['checkpoint']['bytes'])} in {w['checkpoint']['files']} files, "
            f"warm page cache; memcpy limit {memcpy:.2f} GB/s.\n\n"
            + md_table(["scenario", "method", "GB/s", "vs memcpy", "note"], body))


def _peers(p: dict[str, Any]) -> str:
    from .peers import peer_names, ratio_rows, spread

    names = peer_names(p)
    body = [[format_size(r["size"]), r["op"], f"{r['ours']:.2f}", *(f"{r[n]:.2f}" for n in names),
             *(_x(r[f"ratio_{n}"]) for n in names), *(spread(r[f"runs_{n}"]) for n in names[:1]),
             "-" if r.get("bare") is None else f"{r['bare']:.2f}", _x(r.get("ratio_bare"))] for r in ratio_rows(p)]
    return (f"LMCache 0.5.6 `lmcache bench l2` vs the tierstore disk tier (not durable; neither fsyncs), "
            f"{format_size(p['total_bytes'])} per run (rounds of fresh keys, one warm-up), alternating, "
            f"median of {p['repeats']} runs; "
            "GB/s = bytes per round ÷ mean round time; every run starts after a `sync`. *bare* is the limit of our "
            "loads: the same object files read again on the same threads with nothing but `open` + one `preadv` + "
            "xxh3 + `close` per file (LMCache's readers are C++ and check no checksum); for *load, verify once* "
            "(the disk tier with `verify_reads: once`, which skips the checksum of files it wrote or verified) "
            "`open` + `fstat` + one `preadv`. *Per run* is tierstore ÷ the peer within each repeat (min–max): "
            "how far one run's ratio strays on this machine.\n\n"
            + md_table(["object", "op", "tierstore GB/s", *(f"LMCache {n} GB/s" for n in names),
                        *(f"tierstore ÷ {n}" for n in names), *(f"per run ÷ {n}" for n in names[:1]), "bare GB/s",
                        "tierstore ÷ bare"], body))


def _promotion(p: dict[str, Any]) -> str:
    rows = [[label, f"{1e3 * p[name]['s']:.1f}", f"{p[name]['gets']:.0f}", _x(p[name]["s"] / p["transient"]["s"])]
            for name, label in (("transient", "transient (reference)"), ("retain", "retain"),
                                ("retain_with_put", "retain, one put by another thread meanwhile"))]
    wb = p["writeback"]
    return (f"One `get_many` of {p['count']} × {format_size(p['size'])} chunks only the remote holds, on a fresh "
            f"host + disk + remote store, median of {p['repeats']}; GETs counted at the shim for those chunks.\n\n"
            + md_table(["get_many", "ms", "GETs", "÷ transient"], rows)
            + f"\n\nDisk → remote write-back of {p['count']} chunks uploaded {wb['uploaded_bytes']:,} bytes for "
              f"{wb['object_bytes']:,} bytes of objects on disk ({wb['ratio']:.3f}×): the object moves as it is.")


def _fleet(rows: list[dict[str, Any]]) -> str:
    from .fleet import __doc__ as doc
    from .fleet import table

    return (" ".join((doc or "").split("\n\n")[1].split()) + "\n\n" + table(rows))


def _gc(rows: list[dict[str, Any]]) -> str:
    from .gc import table

    return ("One `collect_garbage(max_size=half the prefix)` per row, on a fresh prefix of that many objects "
            "(S3: the local server through the request-counting shim).\n\n" + table(rows))


def _metrics(m: dict[str, Any]) -> str:
    from .metrics import table

    return table(m)


def _server(r: dict[str, Any]) -> str:
    from .server import table

    return table(r)


def _trust(t: dict[str, Any]) -> str:
    from .trust import table

    return table(t)


def _deployment_results(d: dict[str, Any]) -> dict[str, Any]:
    from .qa import Result

    return {name: Result.from_json(r) for name, r in d["configurations"].items()}


def _deployment(d: dict[str, Any]) -> str:
    from .qa import Result
    from .serve import compare

    results = _deployment_results(d)
    w = next(iter(results.values())).workload
    def shown(r: Result) -> str:
        first = r.hit_rates[min(r.hit_rates)] if r.hit_rates else {}
        return ", ".join(f"{k} {100 * v:.1f}%" for k, v in sorted(first.items())) or "-"
    rates = "; ".join(f"{name}: {shown(r)}" for name, r in results.items())
    return (f"Run separately (it starts two vLLM servers and the router per configuration; about 5 minutes "
            f"each here) on {d['date']}:\n\n```\n{d['command']}\n```\n\n"
            f"{w.users} users × {w.rounds} rounds, a shared system prompt of {w.system_words} words and a history "
            f"of {w.history_words} words per user, answers of {w.answer_tokens} tokens; see `SERVE.md` for the "
            "model, the engines' KV space and what the figures show. \"Other instance's prefix\": the TTFT on "
            "instance b of a prompt whose long prefix only instance a computed, median of 3.\n\n"
            + compare(results) + f"\n\nToken hit rates: {rates}.")


def _targets(s: dict[str, Any]) -> str:
    rows: list[list[str]] = []

    def add(name: str, value: str, ratio: float | None, target: float) -> None:
        met = "-" if ratio is None else ("met" if ratio >= target else "missed")
        rows.append([name, value, _x(ratio), f"≥ {target:g}×", met])

    if "deployment" in s:
        from .serve import deployment_targets

        for what, value, ratio, target in deployment_targets(_deployment_results(s["deployment"])):
            add(what, value, ratio, target)

    if "peers" in s:
        from .peers import ratio_rows
        for r in ratio_rows(s["peers"]):
            add(f"disk {r['op']} {format_size(r['size'])} vs LMCache fs_native", f"{r['ours']:.2f} GB/s",
                r.get("ratio_fs_native"), 1.0)
    for r in s.get("tiers", []):
        if r["size"] >= 1 << 20:
            add(f"host get(out=) {format_size(r['size'])} vs memcpy", f"{r['host_get']:.2f} GB/s",
                _ratio(r["host_get"], r["memcpy"]), 0.8)
    if "remote" in s:
        r = s["remote"]
        add(f"remote store get {r['count']} × {format_size(r['size'])} vs ceiling", f"{r['get']:.3f} GB/s",
            _ratio(r["get"], r["ceiling"]), 0.8)
        add(f"remote backend read_many {r['count']} × {format_size(r['size'])} vs ceiling",
            f"{r['tier_get_many']:.3f} GB/s", _ratio(r["tier_get_many"], r["ceiling"]), 0.8)
        if "cold" in r:
            c = r["cold"]
            n = f"{c['count']} × {format_size(c['size'])}"
            add(f"cold lookup of {c['count']} keys ≤ 100 ms", f"{1e3 * c['lookup']['s']:.0f} ms (HEAD ceiling "
                f"{1e3 * c['head_ceiling']['s']:.0f} ms), {c['lookup_spaced']['round_trips']} round trips",
                _ratio(0.1, c["lookup"]["s"]), 1.0)
            add(f"cold load {n} ≤ 0.5 s", f"{1e3 * c['load']['s']:.0f} ms (GET ceiling "
                f"{1e3 * c['get_ceiling']['s']:.0f} ms), {c['load_spaced']['round_trips']} round trips",
                _ratio(0.5, c["load"]["s"]), 1.0)
    if "promotion" in s:
        p = s["promotion"]
        n = f"{p['count']} × {format_size(p['size'])} remote chunks"
        add(f"get_many of {n}: retain ≤ 1.3× transient", f"{1e3 * p['retain']['s']:.0f} ms vs "
            f"{1e3 * p['transient']['s']:.0f} ms", _ratio(1.3, p["retain_vs_transient"]), 1.0)
        add(f"get_many of {n} with a concurrent put ≤ 1.2× without", f"{1e3 * p['retain_with_put']['s']:.0f} ms, "
            f"{p['retain_with_put']['gets']:.0f} GETs", _ratio(1.2, p["put_vs_quiet"]), 1.0)
        wb = p["writeback"]
        add("disk → remote write-back: bytes uploaded = object bytes", f"{wb['uploaded_bytes']:,} B for "
            f"{wb['object_bytes']:,} B", None if not wb["object_bytes"] else 1.0 - abs(wb["ratio"] - 1.0), 1.0)
    for r in s.get("gc", []):
        if r["backend"] == "s3":
            add(f"gc of {r['objects']:,} S3 objects: 0 GETs, ≤ 1 LIST per 1,000", f"{r['object_gets']} GETs, "
                f"{r['lists']} LISTs", 1.0 if r["object_gets"] == 0 and r["lists"] <= -(-r["objects"] // 1000) else 0.0,
                1.0)
    fleet_rows = s.get("fleet", [])
    if len(fleet_rows) >= 2:
        a, b = fleet_rows[0], fleet_rows[-1]
        add(f"fleet: lookup at {b['instances']} instances ≤ 1.3× at {a['instances']}", f"{b['lookup_ms']:.0f} ms vs "
            f"{a['lookup_ms']:.0f} ms", _ratio(1.3, b["lookup_ms"] / a["lookup_ms"]), 1.0)
    if "metrics" in s:
        m = s["metrics"]
        add(f"put/get of {format_size(m['size'])} chunks, metrics on ≥ 0.97× off", f"{m['us_per_call_on']:.1f} µs "
            f"vs {m['us_per_call_off']:.1f} µs per call", m["on_vs_off"] / 0.97, 1.0)
    for c in s.get("server", {}).get("cases", []):
        from .server import TARGETS

        want = TARGETS.get(c["case"])
        if want is None:
            continue
        add(f"{c['case']} through a node server ≥ {want}× in process", f"{c['server_gbps']:.2f} vs "
            f"{c['in_process_gbps']:.2f} GB/s", c["ratio"] / want, 1.0)
    if "trust" in s:
        t = s["trust"]
        n = f"{t['count']} × {format_size(t['size'])}"
        for backend, b in t["backends"].items():
            m = b["remote_get_many"]
            add(f"{backend} remote get_many of {n}: auth on ≥ 0.9× off", f"{1e3 * m['on_s']:.0f} ms vs "
                f"{1e3 * m['off_s']:.0f} ms", m["on_vs_off"] / 0.9, 1.0)
            m = b["promoted_disk_load"]
            add(f"disk load of {n} promoted from {backend}: auth on ≥ 0.95× off", f"{1e3 * m['on_s']:.1f} ms vs "
                f"{1e3 * m['off_s']:.1f} ms", m["on_vs_off"] / 0.95, 1.0)
    for r in s.get("kv", {}).get("paged_load", []):
        if r["path"] != "load+scatter":
            add(f"KV TTFT {r['path']} vs load+scatter ({r['tier']}, {s['kv']['meta'].get('paged_tokens', '?')} "
                "tokens)", f"{1e3 * r['ttft_s']:.1f} ms", r["speedup"], 1.2 if "layerwise" in r["path"] else 1.5)
    big = max(s.get("control", []), key=lambda r: r["keys"], default=None)
    if big:
        add(f"lookup ≤ 2 µs/key at {big['keys']:,} keys", f"{big['lookup_us_per_key']:.3f} µs",
            _ratio(2.0, big["lookup_us_per_key"]), 1.0)
        add(f"index ≤ 200 B/key at {big['keys']:,} keys", f"{big['index_bytes_per_key']:.0f} B",
            _ratio(200.0, big["index_bytes_per_key"]), 1.0)
    return md_table(["target (issues 9, 17, 18, 19, 20, 21, 22)", "measured", "ratio", "target", ""], rows)


def write_report(results: dict[str, Any], out: str) -> list[str]:
    """Write ``out/BENCHMARKS.md`` and the plots; returns the file names written."""
    s, m = results["sections"], results["machine"]
    plots = _plots(s, out)
    deployment = os.path.join(out, DEPLOYMENT)
    if os.path.exists(deployment):  # `bench serve --launch --json` (too long for this run), kept beside it
        with open(deployment) as f:
            s = {**s, "deployment": json.load(f)}
        plots += [p for p in (DEPLOYMENT_PLOT,) if os.path.exists(os.path.join(out, p))]
    parts = ["# tierstore benchmarks", "",
             f"Generated by `tierstore bench all{' --quick' if results['quick'] else ''}` on {m['date']}"
             f"{' at commit ' + m['commit'] if m.get('commit') else ''}, in {results['elapsed_s']:.0f} s.",
             f"Machine: {m['cores']} cores, {m.get('ram_gib', '?')} GiB RAM, {m.get('cpu', 'unknown CPU')}, "
             f"kernel {m['kernel']}, Python {m['python']}, torch {m['torch']} ({m['torch_threads']} threads).",
             "Every figure stands beside its limit or peer measured in the same run, timed in alternation with it;",
             "ratios > 1 favour tierstore. On a shared or small machine absolute figures move between runs",
             "(±30% here); the ratios are the result.",
             "", "## Targets", "", _targets(s)]
    sections: list[tuple[str, str, Callable[[Any], str], str | None]] = [
               ("tiers", "Tier throughput per object size vs the physical limit", _tiers, "tiers.png"),
                ("remote", "Remote tier through the S3 shim (20 ms first byte, 90 MB/s per connection)", _remote,
                 None),
                ("promotion", "Promotion and write-back as a reader sees them (S3 shim, 20 ms first byte)",
                 _promotion, None),
                ("metrics", "What the Prometheus metrics cost the put/get path", _metrics, None),
                ("server", "A get through a node server (tierstore serve) vs in process", _server, None),
                ("trust", "What sealing a shared tier (auth) costs a reader", _trust, None),
                ("gc", "Keeping a shared prefix within budget (gc --max-size, from listings only)", _gc, None),
                ("fleet", "A fleet on one S3 prefix with a gc sidecar (instances are threads, each its own store)",
                 _fleet, None),
                ("kv", "KV cache: multi-round-chat TTFT per store configuration", _kv, "kv_ttft.png"),
                ("deployment", "The guide's deployment: two vLLM servers behind vllm-router, multi-round QA",
                 _deployment, DEPLOYMENT_PLOT),
                ("control", "Control plane: lookup cost and index memory vs index size", _control, "lookup.png"),
                ("weights", "Weight loading (local checkpoint)", _weights, None),
                ("peers", "Peer: LMCache 0.5.6 storage backends", _peers, "peers.png")]
    for key, title, render, png in sections:
        if key not in s:
            continue
        parts += ["", f"## {title}", "", render(s[key])]
        if png and png in plots:
            parts += ["", f"![{title}]({png})"]
    with open(os.path.join(out, "BENCHMARKS.md"), "w") as f:
        f.write("\n".join(parts) + "\n")
    return ["BENCHMARKS.md", *plots]


def _plots(s: dict[str, Any], out: str) -> list[str]:
    try:
        import matplotlib
    except ImportError:
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    if s.get("tiers"):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        xs = [r["size"] / 1024 for r in s["tiers"]]
        for i, (label, key, limit) in enumerate(TIER_SERIES):
            color = f"C{i}"
            ax.plot(xs, [r[key] for r in s["tiers"]], "o-", color=color, label=label)
            ax.plot(xs, [r[limit] for r in s["tiers"]], "--", color=color, label=LIMIT_LABELS[limit] + " (limit)")
        ax.set(xscale="log", xlabel="object size (KiB)", ylabel="GB/s", title="Tier throughput vs object size")
        ax.legend(fontsize=8)
        written.append(_save(fig, out, "tiers.png"))
    if s.get("kv"):
        scen = s["kv"]["scenarios"]
        fig, ax = plt.subplots(figsize=(7, 4))
        names = [x["scenario"] for x in scen]
        width = 0.27
        for i, q in enumerate(("p50", "p90", "p99")):
            ax.bar([j + (i - 1) * width for j in range(len(names))], [1e3 * x["ttft_s"][q] for x in scen], width,
                   label=q.upper())
        ax.set_xticks(range(len(names)), names)
        ax.set(ylabel="TTFT (ms)", title="KV multi-round chat: TTFT per configuration")
        ax.legend()
        written.append(_save(fig, out, "kv_ttft.png"))
    if s.get("control"):
        rows = s["control"]
        fig, ax = plt.subplots(figsize=(7, 4))
        xs = [r["keys"] for r in rows]
        ax.plot(xs, [r["lookup_us_per_key"] for r in rows], "o-", color="C0", label="lookup µs/key")
        ax.axhline(2.0, ls="--", color="C0", label="target 2 µs/key")
        ax.set(xscale="log", xlabel="keys in the index", ylabel="lookup µs per key",
               title="Lookup cost and index memory vs index size")
        ax2 = ax.twinx()
        ax2.plot(xs, [r["index_bytes_per_key"] for r in rows], "s-", color="C1", label="index bytes/key")
        ax2.axhline(200, ls="--", color="C1", label="target 200 B/key")
        ax2.set_ylabel("index bytes per key")
        ax.set_ylim(bottom=0)
        ax2.set_ylim(bottom=0)
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="center right")
        written.append(_save(fig, out, "lookup.png"))
    if s.get("peers"):
        from .peers import peer_names, ratio_rows
        p = s["peers"]
        fig, axes = plt.subplots(1, 2, figsize=(9, 4))
        for ax, op in zip(axes, ("load", "store"), strict=True):
            rows = [r for r in ratio_rows(p) if r["op"] == op]
            systems = [("tierstore disk", "ours")] + [(f"LMCache {n}", n) for n in peer_names(p)]
            width = 0.8 / len(systems)
            for i, (label, key) in enumerate(systems):
                ax.bar([j + (i - (len(systems) - 1) / 2) * width for j in range(len(rows))], [r[key] for r in rows],
                       width, label=label)
            ax.set_xticks(range(len(rows)), [format_size(r["size"]) for r in rows])
            ax.set(ylabel="GB/s", title=op)
        axes[0].legend(fontsize=8)
        fig.suptitle("LMCache bench l2 vs tierstore disk tier")
        written.append(_save(fig, out, "peers.png"))
    return written


def _save(fig: Any, out: str, name: str) -> str:
    fig.tight_layout()
    fig.savefig(os.path.join(out, name), dpi=110)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return name
