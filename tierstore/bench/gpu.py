"""``tierstore bench gpu``: what reaches the GPU, against the host-to-device limit measured in the same run.

Sections (medians of ``--repeats``; every row carries a ratio against a limit or baseline of the same run):

* ``h2d`` — the limits: ``copy_(non_blocking=True)`` of one large buffer from pinned memory (**the limit**
  the other rows are compared with), the same in 4 MiB pieces, from pageable memory, and D2H into pinned;
* ``store`` — ``store.get_many(out=<CUDA tensors>)`` from the host tier (a pinned pool) and from the disk
  tier (page cache warm: every object was read once before the timed runs), and the disk tier into CPU
  tensors (what the disk part costs alone);
* ``kv`` — ``KVCacheStore.load_into`` a CUDA paged cache (vLLM layout, bf16) from the host tier, whole and
  layer-wise (one object per layer), and ``save_from`` it;
* ``weights`` — a synthetic Llama-like safetensors checkpoint on local disk (written to a temp dir, removed
  after) loaded to CUDA by ``tierstore.weights.load`` / ``load_into`` and by ``safetensors.torch.load_file(
  device="cuda")``, page cache warm for both (the files are read once first).

Every measured transfer is also checked value for value once. Without CUDA it prints one line and exits 0;
``--device cpu`` runs the same code on CPU (a dry run of the bench's logic: its figures say nothing about a
GPU). ``--json PATH`` is rewritten after each section, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from ..cliargs import positive_float, positive_int
from ..sizes import format_size, parse_size
from ..store import open_tiered
from .common import Report, Row, gbps, median_time

SECTIONS = ("h2d", "store", "kv", "weights")


def add_arguments(p) -> None:
    p.add_argument("--device", default="cuda", help="torch device to measure (default cuda); 'cpu' is a dry run "
                                                    "of the bench's code on CPU, not a measurement")
    p.add_argument("--h2d-size", default="1GiB", help="bytes of the raw copies (default 1GiB)")
    p.add_argument("--chunk", default="4MiB", help="chunk size of the store rows (default 4MiB)")
    p.add_argument("--store-total", default="1GiB", help="bytes per store get_many (default 1GiB)")
    p.add_argument("--kv-tokens", type=positive_int, default=8192,
                   help="tokens loaded into the paged cache (default 8192)")
    p.add_argument("--kv-layers", type=positive_int, default=32, help="layers (default 32)")
    p.add_argument("--kv-heads", type=positive_int, default=8, help="KV heads (default 8)")
    p.add_argument("--kv-head-dim", type=positive_int, default=128, help="head dim (default 128)")
    p.add_argument("--kv-chunk", type=positive_int, default=256, help="tokens per stored chunk (default 256)")
    p.add_argument("--kv-block", type=positive_int, default=16, help="tokens per cache block (default 16)")
    p.add_argument("--weights-size", default="2GiB", help="synthetic checkpoint size (default 2GiB)")
    p.add_argument("--repeats", type=positive_int, default=5, help="repeats per row, medians reported (default 5; the "
                                                          "weights rows take at most 3)")
    p.add_argument("--only", default=None, help=f"comma-separated sections to run (of {','.join(SECTIONS)})")
    p.add_argument("--budget", type=positive_float, default=150.0,
                   help="seconds: sections not started by then are skipped (default 150)")
    p.add_argument("--dir", default=None, help="scratch directory for the disk tier and the checkpoint "
                                               "(default: a temp dir, removed after)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON here")


class _Bench:
    def __init__(self, args: argparse.Namespace, device: torch.device):
        self.args, self.device = args, device
        self.cuda = device.type == "cuda"
        self.repeats = max(1, args.repeats)
        self.report = Report(f"tierstore bench gpu on {describe(device)}: median of {self.repeats}",
                             meta=meta(args, device))
        self.limit: Row | None = None  # pinned H2D, the row the others are compared with
        self.d2h: Row | None = None
        self.errors: list[str] = []
        self.t0 = time.monotonic()

    # ------------------------------------------------------------------ helpers
    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def time(self, fn: Callable[[], object], repeats: int | None = None,
             setup: Callable[[], object] | None = None) -> float:
        """Median seconds of ``fn`` (each run ends when the device is done), after one untimed warm-up."""

        def prepare() -> None:
            if setup is not None:
                setup()
            self.sync()

        def run() -> None:
            fn()
            self.sync()

        prepare()
        run()
        return median_time(run, repeats or self.repeats, setup=prepare)

    def add(self, name: str, nbytes: int, seconds: float, baseline: Row | None = None, note: str = "") -> Row:
        return self.report.add(name, gbps(nbytes, seconds), "GB/s", baseline, note=note)

    def exact(self, what: str, ok: bool) -> str:
        if not ok:
            self.errors.append(f"{what}: values differ")
        return "exact" if ok else "VALUES DIFFER"

    def random_bytes(self, n: int, seed: int) -> torch.Tensor:
        """``n`` random bytes in (pageable) host memory, made on the device (fast) when it is a GPU."""
        g = torch.Generator(device=self.device).manual_seed(seed)
        return torch.randint(0, 256, (n,), dtype=torch.uint8, device=self.device, generator=g).cpu()

    def pinned(self, n: int) -> torch.Tensor:
        t = torch.empty(n, dtype=torch.uint8, pin_memory=self.cuda)
        t.fill_(1)  # touched: no page faults in the timed copies
        return t

    # ------------------------------------------------------------------ sections
    def h2d(self) -> None:
        n = parse_size(self.args.h2d_size, key="--h2d-size")
        host, dst = self.pinned(n), torch.empty(n, dtype=torch.uint8, device=self.device)
        pageable = torch.ones(n, dtype=torch.uint8)
        self.limit = self.add("H2D from pinned (limit)", n, self.time(lambda: dst.copy_(host, non_blocking=True)),
                              note=f"one copy_(non_blocking=True) of {format_size(n)}")
        piece = min(parse_size(self.args.chunk, key="--chunk"), n)

        def pieces() -> None:
            for off in range(0, n - piece + 1, piece):
                dst[off:off + piece].copy_(host[off:off + piece], non_blocking=True)

        done = n // piece * piece
        self.add(f"H2D from pinned, {format_size(piece)} copies", done, self.time(pieces), self.limit,
                 note="per-copy cost at the store's chunk size")
        self.add("H2D from pageable", n, self.time(lambda: dst.copy_(pageable, non_blocking=True)), self.limit,
                 note="what unpinned staging would get")
        self.d2h = self.add("D2H into pinned", n, self.time(lambda: host.copy_(dst, non_blocking=True)), self.limit,
                            note="vs the H2D limit")
        src = self.random_bytes(n, 1)
        host.copy_(src)
        dst.copy_(host, non_blocking=True)
        self.sync()  # the copy reads host until it is done
        host.zero_()
        host.copy_(dst, non_blocking=True)
        self.sync()
        self.report.meta["h2d_round_trip"] = self.exact("H2D/D2H round trip", torch.equal(host, src))

    def store(self, tmp: str) -> None:

        from ..keys import ChunkKey

        size = parse_size(self.args.chunk, key="--chunk")
        count = max(1, parse_size(self.args.store_total, key="--store-total") // size)
        total, half = count * size, size // 2
        blob = self.random_bytes(total, 2)
        keys = [ChunkKey.from_bytes(f"tierstore-bench-gpu-{i}".encode()) for i in range(count)]
        items = [(k, {"k": blob[i * size:i * size + half].view(torch.bfloat16),
                      "v": blob[i * size + half:(i + 1) * size].view(torch.bfloat16)}) for i, k in enumerate(keys)]
        outs = [{n: torch.empty_like(t, device=self.device) for n, t in v.items()} for _, v in items]
        on_device = blob.to(self.device)

        def check(what: str) -> str:
            got = torch.cat([torch.cat([o["k"].view(torch.uint8), o["v"].view(torch.uint8)]) for o in outs])
            return self.exact(what, torch.equal(got, on_device))

        def get_all(store: Any, into: list[dict[str, torch.Tensor]]) -> None:
            if any(r is None for r in store.get_many(keys, out=into)):
                raise RuntimeError("the store missed a chunk it holds")

        label = f"{count} x {format_size(size)}"
        host_cfg = {"kind": "host", "capacity": total + total // 8 + (64 << 20), "pinned": True}
        with open_tiered({"tiers": [host_cfg]}) as store:
            if not all(store.put_many(items)):
                raise RuntimeError("the host tier refused a chunk")
            t = self.time(lambda: get_all(store, outs))
            note = check("host tier -> device")
            self.add(f"get_many(out={self.device.type}), host tier", total, t, self.limit,
                     note=f"pinned pool, {label}; {note}")
        disk_cfg = {"kind": "disk", "path": os.path.join(tmp, "disk"), "capacity": 2 * total + (64 << 20)}
        with open_tiered({"tiers": [disk_cfg]}) as store:
            if not all(store.put_many(items)):
                raise RuntimeError("the disk tier refused a chunk")
            store.flush()
            for o in outs:
                for t_ in o.values():
                    t_.zero_()
            t = self.time(lambda: get_all(store, outs))
            note = check("disk tier -> device")
            self.add(f"get_many(out={self.device.type}), disk tier", total, t, self.limit,
                     note=f"page cache warm; {note}")
            cpu_outs = [{n: torch.empty_like(t_) for n, t_ in v.items()} for _, v in items]
            t = self.time(lambda: get_all(store, cpu_outs))
            self.add("get_many(out=cpu), disk tier", total, t, self.limit, note="the disk part alone")

    def kv(self) -> None:

        from ..kv import KVCacheStore, KVNamespace
        from ..kv.transfer import LayerwiseLoad

        a = self.args
        layers, heads, dim, ct, bs = a.kv_layers, a.kv_heads, a.kv_head_dim, a.kv_chunk, a.kv_block
        n = max(ct, a.kv_tokens // ct * ct)
        blocks = -(-n // bs)
        g = torch.Generator(device=self.device).manual_seed(3)
        table = torch.randperm(blocks + 16, generator=g, device=self.device)[:blocks].tolist()
        src = [torch.randn(2, blocks + 16, bs, heads, dim, generator=g, device=self.device, dtype=torch.bfloat16)
               for _ in range(layers)]
        dst = [torch.zeros_like(c) for c in src]
        full = torch.tensor(table[:n // bs], device=self.device)  # the blocks the tokens fill whole
        nbytes = n * layers * 2 * heads * dim * 2
        tokens = list(range(n))
        ns = KVNamespace(model="tierstore-bench-gpu", dtype="bfloat16", layout="mha")
        host_cfg = {"kind": "host", "capacity": 2 * nbytes + nbytes // 8 + (64 << 20), "pinned": True}

        def check(what: str) -> str:
            ok = all(torch.equal(d.index_select(1, full), s.index_select(1, full))
                     for d, s in zip(dst, src, strict=True))
            return self.exact(what, ok)

        def clear() -> None:
            for d in dst:
                d.zero_()

        label = f"{n} tokens x {layers} layers, {heads}x{dim} bf16, chunks of {ct}"
        with open_tiered({"tiers": [host_cfg]}) as store:
            whole = KVCacheStore(store, ns, chunk_tokens=ct)
            per_layer = KVCacheStore(store, ns, chunk_tokens=ct, layers_per_object=1, num_layers=layers)

            def drop() -> None:
                store.delete(whole.keys(tokens))

            def save() -> None:
                if whole.save_from(tokens, src, "vllm", table) != n:
                    raise RuntimeError("save_from stored fewer tokens than asked")

            t = self.time(save, setup=drop)
            self.add(f"KV save_from {self.device.type} cache", nbytes, t, self.d2h or self.limit,
                     note=f"vLLM layout, {label}")

            def load() -> None:
                if whole.load_into(tokens, dst, "vllm", table) != n:
                    raise RuntimeError("load_into loaded fewer tokens than saved")

            t = self.time(load, setup=clear)
            self.add(f"KV load_into {self.device.type} cache", nbytes, t, self.limit,
                     note=f"from the host tier; {check('KV load_into')}")
            if per_layer.save_from(tokens, src, "vllm", table) != n:
                raise RuntimeError("save_from (one object per layer) stored fewer tokens than asked")

            def layerwise() -> None:
                handle = per_layer.load_into(tokens, dst, "vllm", table, layerwise=True)
                assert isinstance(handle, LayerwiseLoad)
                if handle.result(60) != n:
                    raise RuntimeError("layer-wise load_into loaded fewer tokens than saved")

            t = self.time(layerwise, setup=clear)
            self.add("KV load_into, layer-wise", nbytes, t, self.limit,
                     note=f"one object per layer; {check('KV layer-wise load_into')}")

    def weights(self, tmp: str) -> None:
        try:
            from safetensors.torch import load_file

            import tierstore.weights as tw
        except ImportError as exc:
            self.report.add("weights rows skipped", 0.0, "", note=f"cannot import: {exc}")
            self.errors.append(f"weights: {exc}")
            return
        from ..weights.synth import llm_shapes, write_checkpoint

        size = parse_size(self.args.weights_size, key="--weights-size")
        directory = os.path.join(tmp, "ckpt")
        specs = [(name, torch.bfloat16, shape) for name, shape in llm_shapes(size)]
        g = torch.Generator(device=self.device).manual_seed(4)

        def make(i: int) -> torch.Tensor:
            shape = specs[i][2]
            return (torch.randn(shape, generator=g, device=self.device) * 0.02).to(torch.bfloat16).cpu()

        t0 = time.perf_counter()
        paths = write_checkpoint(directory, specs, make, shard_size=1 << 30)
        nbytes = sum(os.path.getsize(p) for p in paths)
        written = time.perf_counter() - t0
        buf = bytearray(8 << 20)
        for p in paths:  # page cache warm for every loader below
            with open(p, "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass
        reps = min(3, self.repeats)
        dev = str(self.device)
        label = f"{format_size(nbytes)} in {len(paths)} files, page cache warm"

        def reference() -> dict[str, torch.Tensor]:
            out: dict[str, torch.Tensor] = {}
            for p in paths:
                out.update(load_file(p, device=dev))
            return out

        base = self.add("safetensors load_file", nbytes, self.time(reference, reps), self.limit,
                        note=f"device={dev!r}; {label}")
        t = self.time(lambda: tw.load(directory, device=self.device), reps)
        want, got = reference(), tw.load(directory, device=self.device)
        ok = sorted(want) == sorted(got) and all(torch.equal(got[k], want[k]) for k in want)
        del got
        note = self.exact("weights.load", ok)
        if self.limit is not None:
            note += f"; {gbps(nbytes, t) / self.limit.value:.2f}x the H2D limit"
        self.add("weights.load", nbytes, t, base, note=f"device={dev!r}; {note}")
        params = {k: torch.empty_like(v) for k, v in want.items()}
        t = self.time(lambda: tw.load_into(params, directory), reps)
        ok = all(torch.equal(params[k], want[k]) for k in want)
        self.add("weights.load_into", nbytes, t, base,
                 note=f"{self.device.type} params; {self.exact('weights.load_into', ok)}")
        self.report.meta["weights"] = {"bytes": nbytes, "files": len(paths), "write_seconds": round(written, 2),
                                       "page_cache": "warm for every loader (files read once before)"}

    # ------------------------------------------------------------------ driver
    def run(self, only: list[str]) -> None:
        tmp = tempfile.mkdtemp(prefix="tierstore-bench-gpu-", dir=self.args.dir)
        try:
            for name in SECTIONS:
                if name not in only:
                    continue
                if time.monotonic() - self.t0 > self.args.budget:
                    self.report.add(f"{name} rows skipped", 0.0, "", note="time budget spent")
                    continue
                t0 = time.monotonic()
                print(f"[{name}] ...", flush=True)
                try:
                    if name in ("store", "weights"):
                        getattr(self, name)(tmp)
                    else:
                        getattr(self, name)()
                except Exception as exc:  # a section that fails does not cost the others
                    traceback.print_exc()
                    self.errors.append(f"{name}: {type(exc).__name__}: {exc}")
                finally:
                    self.report.meta.setdefault("section_seconds", {})[name] = round(time.monotonic() - t0, 1)
                    self.flush_json()
                    if self.cuda:
                        torch.cuda.empty_cache()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def flush_json(self) -> None:
        self.report.meta["errors"] = self.errors
        self.report.meta["seconds"] = round(time.monotonic() - self.t0, 1)
        if self.args.json:
            self.report.write_json(self.args.json)


def describe(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} ({device})"
    return f"{device} (dry run: not a GPU measurement)"


def meta(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    m: dict[str, Any] = {"device": str(device), "torch": torch.__version__, "cuda": torch.version.cuda,
                         "cpus": os.cpu_count(), "repeats": args.repeats,
                         "sizes": {k: getattr(args, k) for k in ("h2d_size", "chunk", "store_total", "kv_tokens",
                                                                 "kv_layers", "kv_heads", "kv_head_dim", "kv_chunk",
                                                                 "kv_block", "weights_size")}}
    if device.type == "cuda":
        m["gpu"] = torch.cuda.get_device_name(device)
    return m


def run(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        line = (f"tierstore bench gpu: no CUDA device here (torch {torch.__version__}, "
                f"CUDA build {torch.version.cuda or 'none'}); nothing measured (--device cpu runs a dry run)")
        print(line)
        if args.json:
            Report("tierstore bench gpu", meta={"skipped": line}).write_json(args.json)
        return 0
    only = SECTIONS if not args.only else tuple(s.strip() for s in args.only.split(",") if s.strip())
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown:
        print(f"tierstore bench gpu: unknown section(s) {unknown}; known: {list(SECTIONS)}")
        return 2
    if device.type == "cuda":
        if device.index is None:  # "cuda": the current device, named with its index from here on
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    bench = _Bench(args, device)
    if device.type != "cuda":
        print(f"tierstore bench gpu: dry run on {device}: the code paths run, the figures are not GPU figures")
    bench.run(list(only))
    print(bench.report.table())
    if bench.errors:
        print("errors:\n  " + "\n  ".join(bench.errors))
    bench.flush_json()
    return 1 if bench.errors else 0
