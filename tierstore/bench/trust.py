"""``tierstore bench trust``: what sealing a shared tier costs a reader.

``count`` chunks of ``size`` bytes are published twice, to a prefix sealed with a key (``auth``) and to one
without, on two backends: a ``file://`` prefix (an NFS mount's stand-in, the fastest remote and so the
harshest place to see a MAC) and the local S3 server (no shim: it is CPU-bound on this machine's cores,
as the MAC is). Per backend, in alternation, median of ``rounds``:

* ``remote get_many``: one ``get_many(out=)`` of every chunk from a remote-only store — every byte crosses
  the trust boundary and is authenticated (target: on ≥ 0.9× off);
* ``promoted disk load``: the chunks promoted into a disk tier above the remote (under ``retain``, by the
  promotion job a ``get_many`` starts, waited for untimed by ``flush``), then
  one ``get_many(out=)`` served by the disk tier — local tiers do not verify, so it should not move
  (target: on ≥ 0.95× off);
* ``encrypted``: the remote ``get_many`` again from a prefix written with ``encrypt: true`` (sealed and
  AES-256-GCM encrypted) against the plain one: what the opt-in encryption costs (no target).

The ratio is the median of the rounds' off ÷ on time ratios (> 1 would favour sealing).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from ..cliargs import positive_int
from ..keyring import format_entries, new_secret
from ..keys import ChunkKey
from ..sizes import format_size


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--count", type=positive_int, default=32, help="chunks per read (default 32)")
    p.add_argument("--size", type=positive_int, default=4 << 20, help="bytes per chunk (default 4 MiB)")
    p.add_argument("--rounds", type=positive_int, default=21, help="rounds per configuration; medians (default 21)")
    p.add_argument("--backends", default="file,s3", help="comma-separated: file, s3 (default both)")
    p.add_argument("--json", default=None, help="also write the results as JSON here")


def _alternate(on: Callable[[], float], off: Callable[[], float], rounds: int) -> dict[str, float]:
    on(), off()  # warm-up: clients, page cache, buffers
    times: dict[str, list[float]] = {"on": [], "off": []}
    for i in range(rounds):
        for name, fn in ((("on", on), ("off", off)) if i % 2 == 0 else (("off", off), ("on", on))):
            times[name].append(fn())
    ratios = [b / a for a, b in zip(times["on"], times["off"], strict=True)]
    return {"on_s": statistics.median(times["on"]), "off_s": statistics.median(times["off"]),
            "on_vs_off": statistics.median(ratios)}


def _reader(store: Any, keys: list[ChunkKey], outs: list[dict[str, torch.Tensor]]) -> Callable[[], float]:
    def once() -> float:
        t0 = time.perf_counter()
        got = store.get_many(keys, out=outs)
        took = time.perf_counter() - t0
        if any(x is None for x in got):
            raise RuntimeError("get_many missed a published chunk")
        return took
    return once


def _backend(tiers: dict[str, dict[str, Any]], disk_dir: str, items: list[tuple[ChunkKey, dict[str, torch.Tensor]]],
             rounds: int) -> dict[str, Any]:
    """Both reads for one backend; ``tiers`` maps ``on``/``off`` to the remote tier's config."""
    import tierstore

    keys = [k for k, _ in items]
    outs = [{"kv": torch.empty_like(v["kv"])} for _, v in items]
    for mode, tier in tiers.items():
        with tierstore.open({"tiers": [tier]}) as w:
            if not all(w.put_many(items)):
                raise RuntimeError(f"could not publish the chunks (auth {mode})")
            w.flush()
    stores = {m: tierstore.open({"tiers": [t]}) for m, t in tiers.items()}
    try:
        remote = _alternate(_reader(stores["on"], keys, outs), _reader(stores["off"], keys, outs), rounds)
        encrypted = _alternate(_reader(stores["encrypted"], keys, outs), _reader(stores["off"], keys, outs), rounds)
    finally:
        for s in stores.values():
            s.close()
    capacity = 4 * sum(v["kv"].numel() for _, v in items)
    stores = {m: tierstore.open({"tiers": [{"kind": "disk", "path": os.path.join(disk_dir, m), "capacity": capacity},
                                           tiers[m]], "prefetch_policy": "retain"}) for m in ("on", "off")}
    try:
        for s in stores.values():
            s.get_many(keys)  # promoted into the disk tier by a background job once this returns
            s.flush()  # waits for the promotions under way too
            if not all("disk" in s.holders(k) for k in keys):
                raise RuntimeError("the chunks were not promoted into the disk tier")
        disk = _alternate(_reader(stores["on"], keys, outs), _reader(stores["off"], keys, outs), rounds)
    finally:
        for s in stores.values():
            s.close()
    return {"remote_get_many": remote, "promoted_disk_load": disk, "remote_get_many_encrypted": encrypted}


def measure(count: int = 32, size: int = 4 << 20, rounds: int = 21, backends: tuple[str, ...] = ("file", "s3"),
            workdir: str | None = None, log: Callable[[str], None] = print) -> dict[str, Any]:
    from ..testing.s3 import local_s3

    g = torch.Generator().manual_seed(7)
    items = [(ChunkKey.from_bytes(b"bench-trust-%d" % i),
              {"kv": torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)}) for i in range(count)]
    res: dict[str, Any] = {"count": count, "size": size, "rounds": rounds, "backends": {}}
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        keyfile = os.path.join(tmp, "keys")
        fd = os.open(keyfile, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(format_entries({"bench": new_secret()}))
        for backend in backends:
            log(f"  trust: {backend}: {count} x {format_size(size)}, auth on vs off, {rounds} rounds")
            with (local_s3() if backend == "s3" else contextlib.nullcontext()) as s3:
                if s3 is not None:
                    bucket = s3.new_bucket("trust")
                    base, extra = f"s3://{bucket}", {"storage_options": s3.storage_options}
                else:
                    base, extra = f"file://{tmp}/{backend}", {}
                auth = {"on": {"keys_file": keyfile}, "encrypted": {"keys_file": keyfile, "encrypt": True}}
                tiers = {m: {"kind": "remote", "url": f"{base}/{m}", "list_on_open": False, **extra,
                             **({"auth": auth[m]} if m in auth else {})} for m in ("on", "off", "encrypted")}
                res["backends"][backend] = _backend(tiers, os.path.join(tmp, f"disk-{backend}"), items, rounds)
    return res


def table(r: dict[str, Any]) -> str:
    n = f"{r['count']} × {format_size(r['size'])}"
    rows = []
    for backend, b in r["backends"].items():
        for name, label, target in (("remote_get_many", f"remote get_many of {n}", 0.9),
                                    ("promoted_disk_load", f"disk load of {n} promoted from it", 0.95),
                                    ("remote_get_many_encrypted", f"remote get_many of {n}, encrypted", None)):
            m = b[name]
            gbps = r["count"] * r["size"] / 1e9
            rows.append(f"| {backend} | {label} | {1e3 * m['off_s']:.1f} ({gbps / m['off_s']:.2f} GB/s) | "
                        f"{1e3 * m['on_s']:.1f} ({gbps / m['on_s']:.2f} GB/s) | {m['on_vs_off']:.3f}× "
                        f"| {f'≥ {target}×' if target else '(opt-in)'} |")
    return (f"Median of {r['rounds']} alternating rounds; the ratio is the median of the rounds' off ÷ on time "
            "ratios; *on* is sealed (and, in the encrypted row, encrypted too).\n\n"
            "| backend | read | auth off, ms | auth on, ms | on ÷ off | target |\n"
            "|---|---|---|---|---|---|\n" + "\n".join(rows))


def run(args: argparse.Namespace) -> int:
    backends = tuple(b.strip() for b in args.backends.split(",") if b.strip())
    unknown = set(backends) - {"file", "s3"}
    if unknown:
        raise SystemExit(f"unknown backend(s) {sorted(unknown)}: choose from file, s3")
    r = measure(args.count, args.size, args.rounds, backends)
    print(table(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0
