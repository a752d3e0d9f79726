"""``tierstore bench all --out DIR``: every bench in one run, written to ``DIR/BENCHMARKS.md`` with PNG
plots and ``DIR/results.json``.

Sections: tier throughput per object size beside its physical limit (memcpy, page-cache read, plain
write); the remote tier through the S3 shim beside its concurrent ceiling, and a cold instance's lookup and load;
KV TTFT per store configuration (``bench kv``); the control plane (``lookup`` per key and index memory per
key from 10k to 1M keys); weight loading (``bench weights``, local, small); LMCache's ``bench l2`` beside
the disk tier (``bench peers``) when its venv exists or with ``--peers``; what promotion and write-back
cost a reader (``bench promotion``). ``--quick`` runs tiny sizes and
no peers in well under a minute, for a smoke test.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import subprocess
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import torch

from ..sizes import parse_size
from . import control, peers, sweep
from .report import write_report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="folder for BENCHMARKS.md, results.json and the plots")
    p.add_argument("--quick", action="store_true", help="tiny sizes, no peers: a smoke test (about 30-60 s on 2 cores)")
    p.add_argument("--peers", action="store_true", help="run the LMCache comparison (builds its venv if missing)")
    p.add_argument("--no-peers", action="store_true", help="skip the LMCache comparison even if its venv exists")
    p.add_argument("--venv", default=str(peers.DEFAULT_VENV), help="LMCache's venv (see bench peers)")
    p.add_argument("--no-weights", action="store_true", help="skip the weight-loading bench")
    p.add_argument("--dir", default=None, help="scratch folder (default: a temp dir)")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: write BENCHMARKS.md again from OUT/results.json (and OUT/serve.json)")


def machine() -> dict[str, Any]:
    """Cores, RAM, CPU model, kernel, Python and torch versions, and the date of this run."""
    info: dict[str, Any] = {"cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
                            "kernel": platform.release(), "torch_threads": torch.get_num_threads(),
                            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        info["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "unknown")
    with contextlib.suppress(OSError, StopIteration, ValueError), open("/proc/meminfo") as f:
        kib = next(int(ln.split()[1]) for ln in f if ln.startswith("MemTotal"))
        info["ram_gib"] = round(kib / 2**20, 1)
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        here = os.path.dirname(os.path.abspath(__file__))
        info["commit"] = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True, timeout=5).stdout.strip()
    return info


def _sub_args(module: Any, argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    module.add_arguments(p)
    return p.parse_args(argv)


def _quietly(fn: Callable[[], Any]) -> tuple[Any, str]:
    """Run ``fn`` with its stdout captured (kept for the log), so the progress lines stay readable."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        value = fn()
    return value, buf.getvalue()


def run(args: argparse.Namespace) -> int:
    from . import kv

    if args.report_only:
        try:
            with open(os.path.join(args.out, "results.json")) as f:
                saved = json.load(f)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"--report-only: no results.json of an earlier run in {args.out}: {exc}") from None
        print("wrote " + ", ".join(write_report(saved, args.out)))
        return 0
    quick = args.quick
    os.makedirs(args.out, exist_ok=True)
    t_start = time.perf_counter()
    results: dict[str, Any] = {"machine": machine(), "quick": quick, "sections": {}}
    sections = results["sections"]
    logs: list[str] = []

    def step(name: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f}s] {name}", flush=True)

    with tempfile.TemporaryDirectory(prefix="tierstore-bench-all-", dir=args.dir) as tmp:
        step("tiers: throughput per object size vs memcpy / page cache / plain write")
        sizes = ["64KiB", "1MiB"] if quick else ["256KiB", "1MiB", "4MiB", "16MiB"]
        sections["tiers"] = sweep.tier_sizes([parse_size(s) for s in sizes], parse_size("4MiB" if quick else "256MiB"),
                                             2 if quick else 5, tmp, log=print)

        step("remote: S3 shim (20 ms first byte, 90 MB/s per connection) vs its concurrent ceiling")
        sections["remote"] = sweep.remote(4, 256 << 10, 4, repeats=1, cold_count=8, cold_size=64 << 10,
                                          cold_in_flight=4) if quick else sweep.remote(32, 4 << 20, 8, repeats=3)

        step("promotion: a remote read under retain vs transient, with a concurrent put; write-back bytes")
        from ..testing.s3 import local_s3
        from . import promotion
        with local_s3() as s3:
            sections["promotion"] = promotion.measure(s3, 8 if quick else 32, (64 << 10) if quick else (1 << 20),
                                                      repeats=1 if quick else 5, workdir=tmp)

        step("metrics: the put/get path with Prometheus metrics on vs off")
        from . import metrics
        sections["metrics"] = metrics.measure(64, 4096, 21 if quick else 101)

        step("server: a get through a node server (tierstore serve) vs in process")
        from . import server
        sections["server"] = server.measure(5 if quick else 31)

        step("trust: what sealing a shared tier costs a reader (file:// and S3)")
        from . import trust
        sections["trust"] = trust.measure(8 if quick else 32, (256 << 10) if quick else (4 << 20),
                                          3 if quick else 15, workdir=tmp)

        step("gc: keeping a shared prefix within budget, requests vs object count")
        from . import gc
        sections["gc"] = gc.measure([1000] if quick else [1000, 10000], [1000] if quick else [1000, 10000, 100000],
                                    workdir=tmp)

        step("fleet: instances sharing one S3 prefix (shim) with a gc sidecar under budget")
        from . import fleet
        with local_s3() as s3:
            sections["fleet"] = fleet.measure(s3, [2, 4] if quick else [8, 16, 32, 64], users=1 if quick else 2,
                                              rounds=2 if quick else 4)

        step("kv: multi-round-chat TTFT per store configuration")
        kv_json = os.path.join(tmp, "kv.json")
        kv_argv = ["--json", kv_json, "--workdir", tmp]
        kv_argv += ["--kv-volume", "1MiB", "--rounds", "1", "--qps", "50", "--system-tokens", "128",
                    "--history-tokens", "128", "--chunk-sizes", "64"] if quick else ["--qps", "4"]
        _, out = _quietly(lambda: kv.run(_sub_args(kv, kv_argv)))
        logs.append(out)
        with open(kv_json) as f:
            sections["kv"] = json.load(f)

        step("control plane: lookup per key and index memory per key")
        counts = [1_000, 10_000] if quick else [10_000, 100_000, 1_000_000]
        sections["control"] = []
        for n in counts:
            print(f"  control: {n:,} keys", flush=True)
            sections["control"].append(control.measure(n, seconds=0.1 if quick else 0.5, workdir=tmp))

        if not (quick or args.no_weights):
            step("weights: local checkpoint loading vs safetensors (256 MiB, warm)")
            from . import weights
            w_json = os.path.join(tmp, "weights.json")
            w_argv = ["--size", "256MiB", "--no-cold", "--no-s3", "--json", w_json,
                      "--dir", os.path.join(tmp, "weights-ckpt")]
            _, out = _quietly(lambda: weights.run(_sub_args(weights, w_argv)))
            logs.append(out)
            with open(w_json) as f:
                sections["weights"] = json.load(f)

        want_peers = not quick and not args.no_peers and (args.peers or peers.lmcache_bin(args.venv).exists())
        if want_peers:
            step("peers: LMCache 0.5.6 bench l2 (fs_native, fs) vs the tierstore disk tier")
            sections["peers"] = peers.measure([parse_size(s) for s in ("256KiB", "4MiB", "16MiB")], 1 << 30, 3,
                                              list(peers.ADAPTERS), args.venv, build=args.peers, workdir=tmp)
            print(peers.table(sections["peers"]))

    results["elapsed_s"] = time.perf_counter() - t_start
    step("writing the report")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    written = write_report(results, args.out)
    with open(os.path.join(args.out, "bench.log"), "w") as f:
        f.write("\n".join(logs))
    print("wrote " + ", ".join(os.path.join(args.out, w) for w in written))
    return 0
