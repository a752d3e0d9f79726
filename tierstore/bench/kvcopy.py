"""``tierstore bench kvcopy``: ``load_into`` / ``save_from`` against the bare copy of the same bytes.

The shape is an engine's: ``--layers`` per-layer caches in vLLM's CPU layout (``vllm_cpu``: ``(blocks, kv_heads,
block_size, 2 * head_dim)``, block size 128 as vLLM's CPU backend uses), bf16, Llama-8B-like by default (32
layers, 8 KV heads × 128), chunks of 256 tokens, a block table in random order. For each prompt length
(``--tokens``) it times, alternating the variants within every repeat and reporting medians and ratios:

* host tier — ``load_into`` vs the *bare scatter*: one ``index_copy_`` per layer from a contiguous canonical
  tensor into the same blocks (its index computed beforehand, 8-byte words as the library copies);
  ``save_from`` (the keys deleted before each run, outside the timing) vs the *bare gather*: one
  ``index_select`` per layer out of the same blocks into a contiguous tensor;
* disk tier, page cache warm — ``load_into`` from a store holding only the disk tier vs the *bare preadv +
  scatter*: each chunk object's payload read with one ``preadv`` into a reusable buffer, then scattered;
* node server — the host-tier pair again through a ``tierstore serve`` process on this host (its host pool mapped
  read-only here, ``tierstore.serve.lending``): ``load_into`` scatters straight from the server's pool,
  ``save_from`` gathers into the connection's staging area and the server copies it into its pool. The server
  runs with ``--threads`` intra-op threads too (more, on a busy machine, spin against each other);
* node server with trusted writers (``server-trusted``: ``serve.trusted_writers``) — the same, but its pool is
  mapped writable here and ``save_from`` gathers straight into pool runs the server reserved: one copy.

The bare copies are the physical limit of what a store could do here: the same bytes, the same blocks, no
store in between. Memory: the caches, the store's copy and one bare buffer, each ``tokens × 128 KiB`` at the
default shape (2 GiB each at 16,384 tokens).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

DTYPE = torch.bfloat16


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", default="4096,16384", help="prompt lengths, comma list (default 4096,16384)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5, help="alternating repeats per variant (median)")
    p.add_argument("--tiers", default="host,disk,server", help="comma list of host, disk, server, server-trusted")
    p.add_argument("--workdir", default=None, help="where the disk tier lives (default: a temp dir)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")


class Shape:
    """The caches of one run and the bare copies' index (computed once, outside every timing)."""

    def __init__(self, args: argparse.Namespace, tokens: int):
        self.tokens, self.layers, self.heads, self.dim = tokens, args.layers, args.kv_heads, args.head_dim
        self.bs, self.chunk = args.block_size, args.chunk_tokens
        blocks = -(-tokens // self.bs)
        gen = torch.Generator().manual_seed(tokens)
        self.block_ids = torch.randperm(blocks, generator=gen)
        self.caches = [torch.empty(blocks, self.heads, self.bs, 2 * self.dim, dtype=DTYPE) for _ in range(self.layers)]
        for c in self.caches:
            c.view(torch.int16).random_(generator=gen)
        self.token_ids = torch.randint(0, 32000, (tokens,), generator=gen)
        # canonical (2, n, heads, dim) row r = (kv, t, h) lives in the cache's (block, head, kv, offset) row
        t = torch.arange(tokens)
        blk, off = self.block_ids[t // self.bs], t % self.bs
        kv = torch.arange(2).view(2, 1, 1)
        h = torch.arange(self.heads).view(1, 1, -1)
        rows = ((blk.view(1, -1, 1) * self.heads + h) * 2 + kv) * self.bs + off.view(1, -1, 1)
        self.index = rows.reshape(-1)
        self.layer_bytes = tokens * 2 * self.heads * self.dim * DTYPE.itemsize
        self.bytes = self.layer_bytes * self.layers

    def rows(self, cache: torch.Tensor) -> torch.Tensor:
        """``cache`` as 8-byte words, one row per (block, head, kv, offset)."""
        return cache.view(-1, 2 * self.dim).view(torch.int64).view(-1, self.dim * DTYPE.itemsize // 8)

    def bare_scatter(self, src: torch.Tensor) -> None:
        for j, c in enumerate(self.caches):
            self.rows(c).index_copy_(0, self.index, self.rows_of(src, j))

    def bare_gather(self, dst: torch.Tensor) -> None:
        for j, c in enumerate(self.caches):
            torch.index_select(self.rows(c), 0, self.index, out=self.rows_of(dst, j))

    def rows_of(self, buf: torch.Tensor, layer: int) -> torch.Tensor:
        return buf[layer * self.layer_bytes:(layer + 1) * self.layer_bytes].view(torch.int64).view(
            -1, self.dim * DTYPE.itemsize // 8)


def _namespace(shape: Shape):  # noqa: ANN202 - tierstore imported late
    import tierstore

    return tierstore.KVNamespace(model="bench/kvcopy", dtype="bfloat16", layout="vllm_cpu",
                                 chunk_tokens=shape.chunk)


def alternate(variants: dict[str, Callable[[], object]], repeats: int,
              setups: dict[str, Callable[[], object]] | None = None) -> dict[str, float]:
    """Median seconds of each variant, the variants run in turn within every repeat (one warm-up round)."""
    setups = setups or {}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(repeats + 1):
        for name, fn in variants.items():
            if name in setups:
                setups[name]()
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            if r:
                times[name].append(dt)
    return {name: statistics.median(ts) for name, ts in times.items()}


def host_tier(shape: Shape, args: argparse.Namespace, bare: torch.Tensor) -> dict[str, float]:
    import tierstore

    capacity = shape.bytes + shape.bytes // 8 + (64 << 20)
    store = tierstore.open({"tiers": [{"kind": "host", "capacity": capacity}]})
    try:
        kv = tierstore.KVCacheStore(store, _namespace(shape))
        keys = kv.keys(shape.token_ids)
        return _timed_pair(kv, shape, args, bare, lambda: store.delete(keys))
    finally:
        store.close()


def _timed_pair(kv, shape: Shape, args: argparse.Namespace, bare: torch.Tensor,  # noqa: ANN001 - a KVCacheStore
                delete: Callable[[], object]) -> dict[str, float]:
    """``load_into``/``save_from`` of ``kv`` alternating with the bare scatter/gather (``delete`` before each save)."""
    assert kv.save_from(shape.token_ids, shape.caches, "vllm_cpu", shape.block_ids) == shape.tokens

    def load() -> None:
        n = kv.load_into(shape.token_ids, shape.caches, "vllm_cpu", shape.block_ids)
        assert n == shape.tokens, n

    def save() -> None:
        n = kv.save_from(shape.token_ids, shape.caches, "vllm_cpu", shape.block_ids)
        assert n == shape.tokens, n

    return alternate({"load_into": load, "bare_scatter": lambda: shape.bare_scatter(bare),
                      "save_from": save, "bare_gather": lambda: shape.bare_gather(bare)},
                     args.repeats, setups={"save_from": delete})


def node_server(shape: Shape, args: argparse.Namespace, bare: torch.Tensor, root: Path, trusted: bool = False
                ) -> dict[str, float]:
    import tierstore

    from .server import start_server

    capacity = shape.bytes + shape.bytes // 8 + (64 << 20)
    work = root / f"server-{shape.tokens}{'-trusted' if trusted else ''}"
    work.mkdir()
    sock = work / "run" / "ts.sock"
    proc = start_server({"tiers": [{"kind": "host", "capacity": capacity, "pinned": False}],
                         "serve": {"socket": str(sock), "trusted_writers": trusted}}, str(work), threads=args.threads)
    try:
        with tierstore.open({"server": f"unix://{sock}"}) as store:
            kv = tierstore.KVCacheStore(store, _namespace(shape))
            keys = kv.keys(shape.token_ids)
            return _timed_pair(kv, shape, args, bare, lambda: store.delete(keys))
    finally:
        proc.terminate()
        proc.wait(30)


def disk_tier(shape: Shape, args: argparse.Namespace, root: Path) -> dict[str, float]:
    import tierstore
    from tierstore import objformat
    from tierstore.backends.file_reads import raw_view

    path = root / f"disk-{shape.tokens}"
    store = tierstore.open({"tiers": [{"kind": "disk", "path": str(path), "capacity": 2 * shape.bytes + (1 << 30)}]})
    try:
        kv = tierstore.KVCacheStore(store, _namespace(shape))
        assert kv.save_from(shape.token_ids, shape.caches, "vllm_cpu", shape.block_ids) == shape.tokens
        store.flush()
        files = {}  # key -> (path, payload offset): where the bare reads go
        for f in path.rglob("*"):
            if f.is_file() and not f.name.startswith("."):
                with open(f, "rb") as fh:
                    head = fh.read(4096)
                try:
                    hdr = objformat.parse_header(head[:32 + objformat.header_length(head)])
                except Exception:  # noqa: BLE001 - not an object (lock file, ...)
                    continue
                files[hdr.key] = (str(f), f.stat().st_size - hdr.stored_size)
        paths = [files[k] for k in kv.keys(shape.token_ids)]
        per_chunk = shape.chunk * 2 * shape.heads * shape.dim * DTYPE.itemsize  # one layer of one chunk
        staging = torch.empty(per_chunk * shape.layers, dtype=torch.uint8)
        words = per_chunk // 8
        row_words = shape.dim * DTYPE.itemsize // 8

        def bare() -> None:  # one preadv per object, then its layers scattered (the object is layer-major)
            for c, (p, off) in enumerate(paths):
                fd = os.open(p, os.O_RDONLY)
                try:
                    got = os.preadv(fd, [raw_view(staging)], off)
                finally:
                    os.close(fd)
                assert got == staging.numel(), got
                index = shape.index.view(2, shape.tokens, shape.heads)[:, c * shape.chunk:(c + 1) * shape.chunk]
                index = index.reshape(-1)
                src = staging.view(torch.int64)
                for j, cache in enumerate(shape.caches):
                    shape.rows(cache).index_copy_(0, index, src[j * words:(j + 1) * words].view(-1, row_words))

        def load() -> None:
            n = kv.load_into(shape.token_ids, shape.caches, "vllm_cpu", shape.block_ids)
            assert n == shape.tokens, n

        load()  # the page cache holds every object (written just now; read once more to be sure)
        return alternate({"load_into": load, "bare_preadv_scatter": bare}, args.repeats)
    finally:
        store.close()


def run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    tiers = [t.strip() for t in args.tiers.split(",") if t.strip()]
    results = []
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        for tokens in (int(t) for t in args.tokens.split(",")):
            shape = Shape(args, tokens)
            row: dict[str, object] = {"tokens": tokens, "bytes": shape.bytes}
            if {"host", "server", "server-trusted"} & set(tiers):
                bare = torch.empty(shape.bytes, dtype=torch.uint8)
                bare.fill_(1)  # touched: the bare copies never page-fault
                if "host" in tiers:
                    row["host"] = host_tier(shape, args, bare)
                if "server" in tiers:
                    row["server"] = node_server(shape, args, bare, Path(tmp))
                if "server-trusted" in tiers:
                    row["server-trusted"] = node_server(shape, args, bare, Path(tmp), trusted=True)
                del bare
                gc.collect()
            if "disk" in tiers:
                row["disk"] = disk_tier(shape, args, Path(tmp))
            results.append(row)
            del shape
            gc.collect()
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "args": vars(args) | {"_module": None}},
                                              indent=2, default=str))
    return 0


def table(results: list[dict]) -> str:
    lines = [f"{'tokens':>7} {'MiB':>6}  {'tier':14} {'ours':11} {'s':>8} {'GB/s':>6}  {'bare':20} {'s':>8} "
             f"{'GB/s':>6}  {'ratio':>6}"]
    pairs = [("host", "load_into", "bare_scatter"), ("host", "save_from", "bare_gather"),
             ("disk", "load_into", "bare_preadv_scatter"), ("server", "load_into", "bare_scatter"),
             ("server", "save_from", "bare_gather"), ("server-trusted", "load_into", "bare_scatter"),
             ("server-trusted", "save_from", "bare_gather")]
    for r in results:
        n = r["bytes"]
        for tier, ours, bare in pairs:
            t = r.get(tier)
            if not t:
                continue
            a, b = t[ours], t[bare]
            lines.append(f"{r['tokens']:>7} {n / 2**20:>6.0f}  {tier:14} {ours:11} {a:>8.4f} {n / a / 1e9:>6.2f}  "
                         f"{bare:20} {b:>8.4f} {n / b / 1e9:>6.2f}  {b / a:>5.2f}x")
    return "\n".join(lines)
