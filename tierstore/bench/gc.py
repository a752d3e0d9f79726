"""``tierstore bench gc``: what keeping a shared prefix within budget costs, against its object count.

For each count, a prefix on the local S3 server (through the request-counting shim, no added latency)
and a ``file://`` prefix are filled with that many objects (object names as the remote backend writes
them; gc reads names, sizes and times only, so the bodies are a few bytes) with spread-out modification
times, then the remote backend's ``collect_garbage(max_size=half)`` runs once. Reported: LIST requests,
object GETs (target 0), DeleteObjects requests, objects removed and seconds. A ``file://`` gc reads no file
either way.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from contextlib import closing
from typing import Any

from ..backends.layout import object_relpath
from ..keys import ChunkKey

BODY = b"x" * 64


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--s3-counts", default="1000,10000", help="object counts on S3 (default 1000,10000)")
    p.add_argument("--file-counts", default="1000,10000,100000", help="object counts on file:// (default "
                   "1000,10000,100000)")
    p.add_argument("--json", default=None, help="also write the results as JSON here")


def _names(n: int) -> list[str]:
    return [object_relpath(ChunkKey.from_bytes(b"bench-gc-%d" % i)) for i in range(n)]


def measure_s3(s3: Any, n: int) -> dict[str, Any]:
    from ..backends.fsspec import FsspecBackend
    from .s3shim import S3Shim

    fs = s3.filesystem()
    bucket = s3.new_bucket("bench-gc")
    root = f"{bucket}/kv"
    fs.pipe({f"{root}/{name}": BODY for name in _names(n)}, batch_size=256)
    with S3Shim(s3.endpoint_url, latency=0.0, bandwidth=0, lifetime=3600) as shim, \
            closing(FsspecBackend(url=f"s3://{root}", storage_options=shim.storage_options(s3.storage_options),
                                  list_on_open=False)) as backend:
        shim.reset()
        t0 = time.perf_counter()
        done = backend.collect_garbage(max_size=n * len(BODY) // 2, grace=0)
        seconds = time.perf_counter() - t0
        st = shim.stats()
    return {"backend": "s3", "objects": n, "lists": st["lists"], "object_gets": sum(st["gets"].values()),
            "bulk_deletes": st["bulk_deletes"], "requests": st["requests"], "removed": done.removed_objects,
            "seconds": seconds}


def measure_file(n: int, workdir: str | None = None) -> dict[str, Any]:
    from ..backends.fsspec import FsspecBackend

    with tempfile.TemporaryDirectory(prefix="tierstore-bench-gc-", dir=workdir) as tmp:
        now = time.time()
        for i, name in enumerate(_names(n)):
            path = os.path.join(tmp, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(BODY)
            t = now - 3600 - i  # spread last uses: LRU order is the creation order reversed
            os.utime(path, (t, t))
        with closing(FsspecBackend(url=f"file://{tmp}", list_on_open=False)) as backend:
            t0 = time.perf_counter()
            done = backend.collect_garbage(max_size=n * len(BODY) // 2, grace=0)
            seconds = time.perf_counter() - t0
    return {"backend": "file", "objects": n, "lists": 1, "object_gets": 0, "bulk_deletes": 0,
            "requests": None, "removed": done.removed_objects, "seconds": seconds}


def measure(s3_counts: list[int], file_counts: list[int], workdir: str | None = None) -> list[dict[str, Any]]:
    from ..testing.s3 import local_s3

    rows = []
    if s3_counts:
        with local_s3() as s3:
            rows += [measure_s3(s3, n) for n in s3_counts]
    rows += [measure_file(n, workdir) for n in file_counts]
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| prefix | objects | LIST requests | object GETs | DeleteObjects | removed | seconds |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['backend']} | {r['objects']:,} | {r['lists'] if r['backend'] == 's3' else '(a walk)'} | "
                     f"{r['object_gets']} | {r['bulk_deletes'] if r['backend'] == 's3' else '-'} | "
                     f"{r['removed']:,} | {r['seconds']:.2f} |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    s3_counts, file_counts = ([int(c) for c in s.split(",") if c] for s in (args.s3_counts, args.file_counts))
    rows = measure(s3_counts, file_counts)
    print("gc --max-size (half the prefix), from one listing; object bodies never read\n")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0
