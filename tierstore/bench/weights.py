"""``tierstore bench weights``: checkpoint loading against the raw limits, safetensors and peers.

Measures, on one synthetic Llama-like checkpoint (written once under ``--dir`` and reused):

* raw limits, in the same run: a one-thread memcpy between existing buffers, a sequential ``readinto``
  of the files into an existing buffer (warm and cold page cache);
* local loaders, warm and cold page cache (``echo 3 > /proc/sys/vm/drop_caches`` before each cold run),
  every one filling the same preallocated parameters: safetensors ``load_file`` + copy, ``safe_open``
  per tensor, tierstore ``load_into`` (reads straight into the parameters), tierstore ``iter_tensors``
  + copy, Run:ai Model Streamer, fastsafetensors (no GDS), tensorizer (its own format, serialized once);
* a published (content-addressed) copy, warm: with the digest check on and off, and a second load
  through a store (host tier), which remembers the object versions that passed;
* S3 (a local moto server behind :mod:`tierstore.bench.s3shim`: 20 ms to first byte, 90 MB/s per
  connection): the server's raw ceiling (concurrent ranged GETs straight to moto), one s3fs stream,
  tierstore without a store, and through a store (host + disk tiers): first load, then second load.

Prints a table (GB/s, ratio to the matching raw limit and to safetensors) and checks the targets;
``--json PATH`` writes everything.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ..cliargs import nonneg_float, positive_int
from ..sizes import format_size, parse_size
from . import weights_peers as peers

GB = 1e9


def add_arguments(p) -> None:
    p.add_argument("--size", default="2GiB", help="checkpoint size (default 2GiB; e.g. 256MiB for a quick run)")
    p.add_argument("--dir", default=None, help="where the synthetic checkpoint lives "
                                              "(default ~/.cache/tierstore/bench-weights-SIZE, removed at the "
                                              "end; a --dir is kept and reused)")
    p.add_argument("--shard-size", default="1GiB", help="shard size of the local checkpoint")
    p.add_argument("--concurrency", type=positive_int, default=None, help="tierstore reads in flight (default: auto)")
    p.add_argument("--block-size", default=None, help="tierstore read size (default 16MiB)")
    p.add_argument("--repeat", type=positive_int, default=1, help="warm runs per row after one warm-up; best is kept")
    p.add_argument("--only", default=None, help="comma-separated substrings: run only matching rows")
    p.add_argument("--no-cold", action="store_true", help="skip the cold page-cache runs")
    p.add_argument("--no-s3", action="store_true", help="skip the S3 runs")
    p.add_argument("--s3-size", default=None, help="size of the S3 checkpoint (default: --size, at most 1GiB)")
    p.add_argument("--s3-shard-size", default="32MiB",
                   help="shard size on S3 (moto copies the whole object on every ranged GET, so huge "
                        "shards would measure moto, not the loaders)")
    p.add_argument("--latency-ms", type=nonneg_float, default=20.0, help="S3 shim first-byte latency")
    p.add_argument("--mbps", type=nonneg_float, default=90.0, help="S3 shim bandwidth per connection, MB/s")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")


def _checkpoint(directory: str, size: int, shard_size: int) -> list[str]:
    from ..weights.synth import write_llm_checkpoint

    marker = os.path.join(directory, ".complete")
    if not os.path.exists(marker):
        shutil.rmtree(directory, ignore_errors=True)
        print(f"writing a {format_size(size)} synthetic checkpoint to {directory} (once) ...", flush=True)
        write_llm_checkpoint(directory, size, shard_size=shard_size)
        open(marker, "w").close()
    return sorted(os.path.join(directory, f) for f in os.listdir(directory) if f.endswith(".safetensors"))


def _params(uri: str) -> dict[str, torch.Tensor]:
    """Preallocated, touched destination tensors with the checkpoint's names, shapes and dtypes."""
    from ..weights.checkpoint import open_checkpoint

    with open_checkpoint(uri) as ckpt:
        return {n: torch.zeros(i.shape, dtype=i.dtype) for n, (_, i) in ckpt.tensors.items()}


def _timed(fn, *a, **k) -> float:
    t0 = time.perf_counter()
    fn(*a, **k)
    return time.perf_counter() - t0


class Results:
    def __init__(self, total: int):
        self.total = total
        self.rows: list[dict[str, Any]] = []
        self.limits: dict[str, Any] = {}

    def add(self, scenario: str, method: str, seconds: float | None, nbytes: int | None = None,
            note: str = "") -> None:
        nbytes = self.total if nbytes is None else nbytes
        gbps = nbytes / seconds / GB if seconds else None
        self.rows.append({"scenario": scenario, "method": method, "seconds": seconds, "bytes": nbytes,
                          "gbps": gbps, "note": note})
        shown = f"{gbps:7.2f} GB/s" if gbps else note
        print(f"  {scenario:<8} {method:<40} {shown}", flush=True)

    def gbps(self, scenario: str, method: str) -> float | None:
        for r in self.rows:
            if r["scenario"] == scenario and r["method"] == method:
                return r["gbps"]
        return None


def _run_row(res: Results, scenario: str, name: str, fn, cold: bool, repeat: int, **kw) -> None:
    try:
        if cold:
            peers.drop_caches()
            res.add(scenario, name, _timed(fn, **kw))
        else:
            _timed(fn, **kw)  # warm-up: page cache, pinned rings, imports
            res.add(scenario, name, min(_timed(fn, **kw) for _ in range(max(1, repeat))))
    except peers.Unavailable as exc:
        res.add(scenario, name, None, note=str(exc))
    except Exception as exc:  # a broken peer is a row, never a failed bench
        res.add(scenario, name, None, note=f"failed: {type(exc).__name__}: {str(exc)[:100]}")


def _local(args, res: Results, paths, directory, params, only) -> None:
    total = res.total
    buf = torch.zeros(max(os.path.getsize(p) for p in paths), dtype=torch.uint8)
    n = min(total, 1 << 30)
    src, dst = peers.memcpy_buffers(n)
    t = min(_timed(peers.memcpy, src, dst) for _ in range(3))
    del src, dst
    res.limits["memcpy"] = n / t / GB
    res.add("limit", "memcpy into an existing buffer (1 thread)", t, n)
    peers.readinto(paths, buf)
    res.add("warm", "raw: sequential readinto", min(_timed(peers.readinto, paths, buf) for _ in range(2)))
    res.limits["readinto_warm"] = res.gbps("warm", "raw: sequential readinto")
    cold_ok = not args.no_cold
    if cold_ok:
        try:
            peers.drop_caches()
            res.add("cold", "raw: sequential readinto", _timed(peers.readinto, paths, buf))
            res.limits["readinto_cold"] = res.gbps("cold", "raw: sequential readinto")
        except peers.Unavailable as exc:
            res.add("cold", "raw: sequential readinto", None, note=str(exc))
            cold_ok = False
    del buf
    kw = dict(paths=paths, params=params, uri=directory, directory=directory,
              concurrency=args.concurrency, block_size=args.block_size)
    rows = [(nm, fn) for nm, fn in peers.LOCAL_ROWS if only is None or any(o in nm for o in only)]
    if any(fn is peers.tensorizer_loader for _, fn in rows):
        try:
            import tierstore.weights as tw
            tw.load_into(params, directory)  # tensorizer serializes the real weights, once
            peers.tensorizer_prepare(directory, params)
        except peers.Unavailable:
            pass
    for scenario in ["warm"] + (["cold"] if cold_ok else []):
        for name, fn in rows:
            for t in params.values():
                t.zero_()
            _run_row(res, scenario, name, fn, scenario == "cold", args.repeat, **kw)
            if res.rows[-1]["gbps"] is not None and not _verify(directory, params):
                res.rows[-1]["note"] = "WRONG DATA in the parameters"


def _published(args, res: Results, directory: str, params) -> None:
    """What the digest check of a published checkpoint costs: the same load with it on and off, and the
    second load through a store (which remembers the versions that passed)."""
    import tierstore
    import tierstore.weights as tw

    pub = directory + "-published"
    done = os.path.join(pub, ".complete-blake3")  # (objects published before had blake2b names)
    if not os.path.exists(done):
        shutil.rmtree(pub, ignore_errors=True)
        print(f"publishing the checkpoint to {pub} (once) ...", flush=True)
        tw.publish(directory, pub)
        open(done, "w").close()
    opts = {k: v for k, v in (("concurrency", args.concurrency), ("block_size", args.block_size)) if v}
    with tierstore.open({"tiers": [{"kind": "host", "capacity": 2 * res.total + (64 << 20)}]}) as store:
        rows = [("tierstore load_into, published: digest checked", {}),
                ("tierstore load_into, published: verify=False", {"verify": False}),
                ("tierstore load_into, published, store: 2nd load", {"store": store})]
        for name, kw in rows:
            for t in params.values():
                t.zero_()
            _run_row(res, "warm", name, lambda kw=kw: tw.load_into(params, pub, **opts, **kw), False, args.repeat)
            if res.rows[-1]["gbps"] is not None and not _verify(directory, params):
                res.rows[-1]["note"] = "WRONG DATA in the parameters"


def _verify(uri, params) -> bool:
    """Check (untimed) that the last load left the checkpoint's bytes in every parameter."""
    from safetensors import safe_open

    from ..weights.checkpoint import open_checkpoint

    with open_checkpoint(uri) as ckpt:
        files = sorted({ckpt.shards[i].source.name for i, _ in ckpt.tensors.values()})
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if not torch.equal(f.get_tensor(name).reshape(-1).view(torch.uint8),
                                   params[name].reshape(-1).view(torch.uint8)):
                    return False
    return True


def _s3(args, res: Results, base_dir: str, params, size: int) -> None:
    import tierstore
    import tierstore.weights as tw

    from ..testing.s3 import start_local_s3
    from .s3shim import S3Shim

    s3_size = parse_size(args.s3_size or min(size, 1 << 30), key="--s3-size")
    shard = parse_size(args.s3_shard_size, key="--s3-shard-size")
    local = f"{base_dir}-s3layout-{shard}" if s3_size == size else f"{base_dir}-s3-{s3_size}-{shard}"
    _checkpoint(local, s3_size, shard)
    if s3_size != size:
        params = _params(local)
    total = sum(t.numel() * t.element_size() for t in params.values())
    server = start_local_s3()
    tmp = tempfile.mkdtemp(prefix="tierstore-bench-")
    try:
        bucket = server.new_bucket("bench")
        fs = server.filesystem()
        print(f"uploading {format_size(total)} to the local S3 server ...", flush=True)
        fs.put(local + "/", f"{bucket}/ck/", recursive=True)
        keys = sorted(k for k in fs.ls(f"{bucket}/ck") if k.endswith(".safetensors"))
        sizes = {k: fs.info(k)["size"] for k in keys}
        conc = args.concurrency or 16
        block = parse_size(args.block_size or "16MiB")  # tierstore's remote default

        def ceiling():
            ranges = [(k, o, min(sizes[k], o + block)) for k in keys for o in range(0, sizes[k], block)]
            with ThreadPoolExecutor(conc) as pool:
                list(pool.map(lambda r: fs.cat_file(r[0], start=r[1], end=r[2]), ranges))
        res.add("s3", "raw: server ceiling (ranged GETs, no shim)", _timed(ceiling), total)
        with S3Shim(server.endpoint_url, args.latency_ms / 1000, args.mbps * 1e6) as shim:
            opts = shim.storage_options(server.storage_options)
            import s3fs
            sfs = s3fs.S3FileSystem(**opts)
            res.add("s3", "s3fs single stream (cat_file)", _timed(lambda: [sfs.cat_file(k) for k in keys]), total)
            url = f"s3://{bucket}/ck"
            res.add("s3", "tierstore load_into (no store)",
                    _timed(tw.load_into, params, url, storage_options=opts, concurrency=args.concurrency,
                           block_size=block), total)
            cfg = {"tiers": [{"kind": "host", "capacity": "256MiB"},
                             {"kind": "disk", "path": os.path.join(tmp, "store"), "capacity": 2 * total + (1 << 30)}]}
            with tierstore.open(cfg) as store:
                kw = dict(storage_options=opts, store=store, concurrency=args.concurrency, block_size=block)
                res.add("s3", "tierstore load_into, store: 1st load", _timed(tw.load_into, params, url, **kw), total)
                store.flush()
                shim.reset()
                res.add("s3", "tierstore load_into, store: 2nd load", _timed(tw.load_into, params, url, **kw), total)
                gets = sum(shim.stats()["gets"].values())
                res.rows[-1]["note"] = f"{gets} object GETs on the 2nd load"
        if not _verify(local, params):
            res.rows[-1]["note"] += "; WRONG DATA in the parameters"
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def _targets(res: Results) -> list[dict]:
    g = res.gbps
    out = []

    def check(name, value, target):
        ok = value is not None and target is not None and value >= target
        out.append({"target": name, "value": value, "needed": target, "met": ok if value is not None else None})

    ours, st = "tierstore load_into (direct)", "safetensors load_file + copy"
    warm_st = g("warm", st)
    if g("warm", ours) and warm_st:
        check("warm: >= 0.9x safetensors", g("warm", ours), 0.9 * warm_st)
        check("warm: >= 0.7x memcpy", g("warm", ours), 0.7 * res.limits["memcpy"])
    if g("cold", ours):
        if res.limits.get("readinto_cold"):
            check("cold: >= 0.8x cold readinto", g("cold", ours), 0.8 * res.limits["readinto_cold"])
        for peer in (st, "Run:ai Model Streamer", "fastsafetensors (nogds, cpu)"):
            if g("cold", peer):
                check(f"cold: faster than {peer}", g("cold", ours), g("cold", peer))
    s3 = g("s3", "tierstore load_into, store: 1st load") or g("s3", "tierstore load_into (no store)")
    single, ceil = g("s3", "s3fs single stream (cat_file)"), g("s3", "raw: server ceiling (ranged GETs, no shim)")
    if g("s3", "tierstore load_into (no store)") and single and ceil:
        check("s3: >= min(4x single stream, 0.8x ceiling)", g("s3", "tierstore load_into (no store)"),
              min(4 * single, 0.8 * ceil))
    if g("s3", "tierstore load_into, store: 2nd load") and s3:
        check("s3: 2nd load via store >= 5x 1st", g("s3", "tierstore load_into, store: 2nd load"), 5 * s3)
    return out


def _print_table(res: Results, targets) -> None:
    st = {sc: res.gbps(sc, "safetensors load_file + copy") for sc in ("warm", "cold")}
    limit = {"warm": res.limits.get("readinto_warm"), "cold": res.limits.get("readinto_cold"),
             "s3": res.gbps("s3", "raw: server ceiling (ranged GETs, no shim)"),
             "limit": res.limits.get("memcpy")}
    print()
    print(f"{'scenario':<8} {'method':<42} {'GB/s':>7} {'x limit':>8} {'x safet.':>8}  note")
    print("-" * 100)
    for r in res.rows:
        if r["gbps"] is None:
            print(f"{r['scenario']:<8} {r['method']:<42} {'-':>7} {'':>8} {'':>8}  {r['note']}")
            continue
        lim = limit.get(r["scenario"])
        base = st.get(r["scenario"])
        ratio_lim = f"{r['gbps'] / lim:8.2f}" if lim else f"{'':>8}"
        ratio_st = f"{r['gbps'] / base:8.2f}" if base else f"{'':>8}"
        print(f"{r['scenario']:<8} {r['method']:<42} {r['gbps']:7.2f} {ratio_lim} {ratio_st}  {r['note']}")
    print(f"\nlimits: memcpy {res.limits.get('memcpy', 0):.2f} GB/s; 'x limit' is vs the raw readinto of the same"
          f" scenario (s3: vs the server ceiling)")
    for t in targets:
        mark = "MET " if t["met"] else "MISS" if t["met"] is False else "n/a "
        print(f"  [{mark}] {t['target']}: {t['value'] or 0:.2f} GB/s (needed {t['needed'] or 0:.2f})")


def run(args) -> int:
    size = parse_size(args.size, key="--size")
    directory = args.dir or os.path.join(os.path.expanduser("~/.cache/tierstore"), f"bench-weights-{size}")
    try:
        return _run(args, size, directory)
    finally:
        if args.dir is None:  # a --dir is kept for the next run; the default is not left behind
            for path in (directory, directory + "-published"):
                shutil.rmtree(path, ignore_errors=True)
            print(f"removed {directory} (and its -published copy); --dir DIR keeps the checkpoint for the next run",
                  flush=True)


def _run(args, size: int, directory: str) -> int:
    paths = _checkpoint(directory, size, parse_size(args.shard_size, key="--shard-size"))
    params = _params(directory)
    total = sum(t.numel() * t.element_size() for t in params.values())
    only = [o.strip() for o in args.only.split(",")] if args.only else None
    print(f"checkpoint: {len(params)} tensors, {format_size(total)} in {len(paths)} file(s), "
          f"{os.cpu_count()} CPUs", flush=True)
    res = Results(total)
    _local(args, res, paths, directory, params, only)
    if only is None or any("published" in o for o in only):
        _published(args, res, directory, params)
    if not args.no_s3:
        _s3(args, res, directory, params, size)
    targets = _targets(res)
    _print_table(res, targets)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"checkpoint": {"dir": directory, "bytes": total, "tensors": len(params), "files": len(paths)},
                       "cpus": os.cpu_count(), "limits": res.limits, "rows": res.rows, "targets": targets,
                       "args": {k: v for k, v in vars(args).items() if not k.startswith("_")}}, f, indent=1,
                      default=str)
    return 0
