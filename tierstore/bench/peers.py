"""``tierstore bench peers``: LMCache 0.5.6's ``lmcache bench l2`` (``fs_native`` and ``fs``) next to the
tierstore disk tier on the same object sizes and bytes per round, alternating, medians of ``--repeats``.

LMCache runs from its own virtual environment (``--venv``; ``--build`` creates it with ``lmcache==0.5.6``
beside ``torch==2.13.0``, which installs and runs on CPU). It is never built in CI. Its file stores do not
fsync, so ours runs without ``durable``. As LMCache's bench does, each run stores one warm-up round and
then ``--total`` bytes in rounds of fresh keys (one batch per round), then reads every round back (warm
page cache): GB/s = bytes per round ÷ mean round time, warm-up excluded. Every run has a fresh folder.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import xxhash

from .. import objformat
from ..backends.file import FileBackend
from ..backends.file_reads import CORES, ONE_READ, raw_view
from ..backends.objfile import open_for_read
from ..cliargs import positive_int
from ..iov import PIECE
from ..keys import ChunkKey
from ..sizes import format_size, parse_size
from ..store import open_tiered
from .ops import get_all_into, put_all

LMCACHE = "lmcache==0.5.6"
TORCH = "torch==2.13.0"
DEFAULT_VENV = Path.home() / ".cache" / "tierstore-bench" / "lmcache-venv"
ADAPTERS = ("fs_native", "fs")
OURS = "tierstore disk"
#: the disk tier with ``verify_reads: once``: a read of a file it wrote or verified skips the checksum
OURS_ONCE = "tierstore disk, verify once"


class Unavailable(Exception):
    """The peer cannot run here; the message says why."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--venv", default=str(DEFAULT_VENV), help=f"LMCache's virtual environment (default {DEFAULT_VENV})")
    p.add_argument("--build", action="store_true", help=f"create --venv with {LMCACHE} and {TORCH} if missing")
    p.add_argument("--sizes", default="256KiB,4MiB,16MiB", help="object sizes (default 256KiB,4MiB,16MiB)")
    p.add_argument("--total", default="1GiB", help="bytes over all measured rounds (default 1GiB)")
    p.add_argument("--rounds", type=positive_int, default=None,
                   help="measured rounds per run (default: see round_shape)")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="runs per configuration; medians reported (default 3)")
    p.add_argument("--adapters", default=",".join(ADAPTERS), help="LMCache L2 adapters (default fs_native,fs)")
    p.add_argument("--dir", default=None, help="scratch folder (default: a temp dir)")
    p.add_argument("--json", default=None, help="also write the results as JSON here")


# ---------------------------------------------------------------------------------------------- the peer
def lmcache_bin(venv: str | os.PathLike[str]) -> Path:
    return Path(venv) / "bin" / "lmcache"


def ensure_venv(venv: str | os.PathLike[str], build: bool, log: Callable[[str], None] = print) -> Path:
    """Path of LMCache's CLI in ``venv``; with ``build``, create the venv first if it is missing."""
    exe = lmcache_bin(venv)
    if exe.exists():
        return exe
    if not build:
        raise Unavailable(f"no LMCache in {venv} (run `tierstore bench peers --build` to create it)")
    log(f"building {venv} with {LMCACHE} and {TORCH} (once; a few minutes) ...")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(Path(venv) / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, TORCH, LMCACHE], check=True)
    if not exe.exists():
        raise Unavailable(f"{LMCACHE} installed but {exe} is missing")
    return exe


def run_lmcache(exe: Path, adapter: str, folder: str, keys: int, size: int, rounds: int) -> dict[str, float]:
    """One ``lmcache bench l2`` run; returns GB/s of ``store`` and ``load`` (bytes ÷ mean round time)."""
    out = os.path.join(folder, "result.json")
    cmd = [str(exe), "bench", "l2", "--l2-adapter",
           json.dumps({"type": adapter, "base_path": os.path.join(folder, "data")}),
           "--num-keys", str(keys), "--data-size-kb", str(size // 1024), "--rounds", str(rounds),
           "--warmup-rounds", "1", "--format", "json", "--output", out]
    env = {**os.environ, "LMCACHE_DISABLE_BANNER": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0 or not os.path.exists(out):
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"lmcache bench l2 ({adapter}) failed with {proc.returncode}: {' | '.join(tail)}")
    with open(out) as f:
        return parse_lmcache(json.load(f), keys * size)


def parse_lmcache(result: dict[str, Any], round_bytes: int) -> dict[str, float]:
    """GB/s of ``store`` and ``load`` from ``bench l2 --format json``: bytes per round ÷ ``duration_avg_ms``."""
    found: dict[str, float] = {}
    for section in result.get("metrics", {}).values():
        op = str(section.get("operation", "")).lower() if isinstance(section, dict) else ""
        if op in ("store", "load"):
            if section.get("total_success") != section.get("total_keys"):
                raise RuntimeError(f"lmcache bench l2: {op} succeeded for {section.get('total_success')} of "
                                   f"{section.get('total_keys')} keys")
            found[op] = round_bytes / (section["duration_avg_ms"] / 1e3) / 1e9
    if set(found) != {"store", "load"}:
        raise RuntimeError(f"lmcache bench l2: no store/load results in {sorted(result.get('metrics', {}))}")
    return found


# ---------------------------------------------------------------------------------------------- ours
def run_ours(folder: str, keys: int, size: int, rounds: int, verify: str = "always") -> dict[str, float]:
    """LMCache's rounds on a tierstore disk tier (not durable; ``verify_reads`` is ``verify``: ``always`` or
    ``once``): every round stores ``keys`` fresh objects in one batch (``put_many`` where the store has it), then
    every round's objects are read back into caller-owned buffers (``get_many(out=)``). Round 0 warms up and is
    not timed."""

    g = torch.Generator().manual_seed(size)
    data = [{"kv": torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)} for _ in range(keys)]
    outs = [{"kv": torch.zeros(size, dtype=torch.uint8)} for _ in range(keys)]
    batches = [[ChunkKey.from_bytes(f"peers-{size}-{r}-{i}".encode()) for i in range(keys)]
               for r in range(rounds + 1)]
    cfg = {"tiers": [{"kind": "disk", "path": os.path.join(folder, "data"),
                      "capacity": (rounds + 2) * keys * size, "verify_reads": verify}]}
    store_t: list[float] = []
    load_t: list[float] = []
    with open_tiered(cfg) as store:
        for batch in batches:
            t0 = time.perf_counter()
            put_all(store, list(zip(batch, data, strict=True)))
            store_t.append(time.perf_counter() - t0)
        for r, batch in enumerate(batches):
            t0 = time.perf_counter()
            got = get_all_into(store, batch, outs)
            load_t.append(time.perf_counter() - t0)
            if any(x is None for x in got):
                raise RuntimeError(f"tierstore disk tier missed its own objects in round {r}")
        if not all(torch.equal(o["kv"], d["kv"]) for o, d in zip(outs, data, strict=True)):
            raise RuntimeError("tierstore disk tier returned wrong bytes")
        disk = store.tier("disk").backend
        assert isinstance(disk, FileBackend)
        paths = [[disk.object_path(k) for k in batch] for batch in batches]
        with ThreadPoolExecutor(CORES) as pool:
            bare_load_t = [bare_read(pool, p, outs, checked=verify == "always") for p in paths]
    total = keys * size
    return {"store": total / statistics.mean(store_t[1:]) / 1e9, "load": total / statistics.mean(load_t[1:]) / 1e9,
            "load_bare": total / statistics.mean(bare_load_t[1:]) / 1e9}


def _on_threads(pool: ThreadPoolExecutor, n: int, threads: int, one: Callable[[int], None]) -> float:
    """Seconds to run ``one(i)`` for every ``i < n``, split over ``threads`` of ``pool``'s threads."""
    threads = max(1, min(threads, n))

    def part(first: int) -> None:
        for i in range(first, n, threads):
            one(i)

    t0 = time.perf_counter()
    list(pool.map(part, range(threads)))
    return time.perf_counter() - t0


def bare_read(pool: ThreadPoolExecutor, paths: Sequence[str], outs: Sequence[dict[str, torch.Tensor]],
              checked: bool = True) -> float:
    """Seconds to read ``paths`` as the disk tier does, minus all its bookkeeping: on the same number of
    threads, each file ``open`` (``O_NOATIME``) + one ``preadv`` (header to scratch, payload into its
    ``outs`` buffer; larger objects in hashed steps) + xxh3 of what was read + ``close``. The limit of
    reading and checking these objects from Python; LMCache's readers are C++ and check no checksum.
    Without ``checked``: one ``fstat`` + one ``preadv`` and no hash (the limit of a trusted read)."""
    views = [raw_view(o["kv"]) for o in outs]

    def trusted(i: int) -> None:
        fd = open_for_read(paths[i])
        try:
            scratch = bytearray(os.fstat(fd).st_size - len(views[i]))
            os.preadv(fd, [scratch, views[i]], 0)
        finally:
            os.close(fd)

    if not checked:
        return _on_threads(pool, len(paths), CORES, trusted)

    def one(i: int) -> None:
        fd = open_for_read(paths[i])
        try:
            view = views[i]
            scratch = bytearray(os.fstat(fd).st_size - len(view))
            step = len(view) if len(view) <= ONE_READ else PIECE  # hashed while in cache, as the tier does
            os.preadv(fd, [scratch, view[:step]], 0)
            h = xxhash.xxh3_128(memoryview(scratch)[objformat.PREFIX_SIZE:])
            h.update(view[:step])
            for at in range(step, len(view), step):
                os.preadv(fd, [view[at:at + step]], len(scratch) + at)
                h.update(view[at:at + step])
            h.digest()
        finally:
            os.close(fd)

    return _on_threads(pool, len(paths), CORES, one)


def round_shape(size: int, total: int) -> tuple[int, int]:
    """(keys per round, measured rounds) for ``total`` bytes over all rounds, as LMCache's own ``bench l2``
    runs: 256 KiB -> 256 keys x 16 rounds, 16 MiB -> 16 keys x 4 rounds."""
    keys = max(1, min(256, (256 << 20) // size))
    return keys, max(2, total // (keys * size))


# ---------------------------------------------------------------------------------------------- driver
def measure(sizes: Sequence[int], total: int, repeats: int, adapters: Sequence[str], venv: str, build: bool = False,
            rounds: int | None = None, workdir: str | None = None,
            log: Callable[[str], None] = print) -> dict[str, Any]:
    """Alternate LMCache's adapters and ours per size and repeat; returns runs and medians (GB/s)."""
    exe = ensure_venv(venv, build, log) if adapters else None
    systems = [*adapters, OURS, OURS_ONCE]
    runs: list[dict[str, Any]] = []
    steps, step = repeats * len(sizes) * len(systems), 0
    for rep in range(repeats):
        for size in sizes:
            keys, n_rounds = round_shape(size, total)
            n_rounds = rounds or n_rounds
            # rotate the order each repeat so no system always runs first on a cold page cache
            order = systems[rep % len(systems):] + systems[:rep % len(systems)]
            for system in order:
                step += 1
                log(f"  [{step}/{steps}] {system:<15} {format_size(size):>7} x {keys} keys, {n_rounds} rounds, "
                    f"repeat {rep + 1}")
                folder = tempfile.mkdtemp(prefix="tierstore-peers-", dir=workdir)
                os.sync()  # no run starts with the previous one's dirty pages still being written back
                try:
                    if system in (OURS, OURS_ONCE):
                        r = run_ours(folder, keys, size, n_rounds, "once" if system == OURS_ONCE else "always")
                    else:
                        assert exe is not None
                        r = run_lmcache(exe, system, folder, keys, size, n_rounds)
                finally:
                    shutil.rmtree(folder, ignore_errors=True)
                runs.append({"system": system, "size": size, "repeat": rep, **r})
    medians = []
    for size in sizes:
        for system in systems:
            mine = [r for r in runs if r["system"] == system and r["size"] == size]
            row: dict[str, Any] = {"system": system, "size": size}
            for op in ("store", "load", "load_bare"):
                if op in mine[0]:
                    row[op] = statistics.median(r[op] for r in mine)
            medians.append(row)
    return {"runs": runs, "medians": medians, "sizes": list(sizes), "systems": systems,
            "total_bytes": total, "repeats": repeats, "lmcache": LMCACHE if adapters else None}


def peer_names(result: dict[str, Any]) -> list[str]:
    """The LMCache adapters measured in ``result`` (its systems but ours)."""
    return [s for s in result["systems"] if s not in (OURS, OURS_ONCE)]


def ratio_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per size and op: our median GB/s, each peer's, and ours ÷ peer; op ``"load, verify once"`` is the
    disk tier with ``verify_reads: once`` (its bare limit reads without a hash)."""
    rows = []
    med = {(m["system"], m["size"]): m for m in result["medians"]}
    runs: dict[tuple[str, int, int], dict[str, Any]] = {(r["system"], r["size"], r["repeat"]): r
                                                       for r in result.get("runs", [])}
    mine = [(OURS, op, op) for op in ("load", "store")]
    if OURS_ONCE in result["systems"]:
        mine.insert(1, (OURS_ONCE, "load", "load, verify once"))
    for size in result["sizes"]:
        for system, op, label in mine:
            ours = med[(system, size)][op]
            bare = med[(system, size)].get(f"{op}_bare")
            row: dict[str, Any] = {"size": size, "op": label, "ours": ours, "bare": bare,
                                   "ratio_bare": ours / bare if bare else None}
            for peer in peer_names(result):
                row[peer] = med[(peer, size)][op]
                row[f"ratio_{peer}"] = ours / row[peer] if row[peer] else float("nan")
                # ours ÷ the peer within each repeat (the two ran minutes apart at most): the spread of the ratio
                row[f"runs_{peer}"] = sorted(
                    runs[(system, size, rep)][op] / runs[(peer, size, rep)][op] for rep in range(result["repeats"])
                    if (system, size, rep) in runs and runs.get((peer, size, rep), {}).get(op))
            rows.append(row)
    return rows


def spread(ratios: Sequence[float]) -> str:
    """Per-repeat ratios as ``min–max`` (``-`` when there are none)."""
    return f"{ratios[0]:.2f}–{ratios[-1]:.2f}" if ratios else "-"


def table(result: dict[str, Any]) -> str:
    peers = peer_names(result)
    head = ["size", "op", "tierstore disk GB/s", *(f"LMCache {p} GB/s" for p in peers),
            *(f"vs {p}" for p in peers), *(f"per run vs {p}" for p in peers[:1]), "bare GB/s", "vs bare"]
    body = [[format_size(r["size"]), r["op"], f"{r['ours']:.2f}", *(f"{r[p]:.2f}" for p in peers),
             *(f"{r[f'ratio_{p}']:.2f}x" for p in peers), *(spread(r[f"runs_{p}"]) for p in peers[:1]),
             *((f"{r['bare']:.2f}", f"{r['ratio_bare']:.2f}x") if r["bare"] else ("-", "-"))]
            for r in ratio_rows(result)]
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
    lines = [" | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in [head, *body]]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    sizes = [parse_size(s, key="--sizes") for s in str(args.sizes).split(",") if s.strip()]
    adapters = [a.strip() for a in str(args.adapters).split(",") if a.strip()]
    total = parse_size(args.total, key="--total")
    try:
        result = measure(sizes, total, args.repeats, adapters, args.venv, args.build, args.rounds, args.dir)
    except Unavailable as exc:
        print(f"tierstore bench peers: {exc}", file=sys.stderr)
        return 2
    print(f"\nLMCache {LMCACHE.split('==')[1]} bench l2 vs tierstore disk tier (not durable): "
          f"{format_size(total)} per run, median of {args.repeats} runs, GB/s = bytes per round / mean round time")
    print(table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
