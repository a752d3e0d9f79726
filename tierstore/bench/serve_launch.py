"""``tierstore bench serve --launch``: the guide's deployment (``examples/deploy/launch.sh``: two API servers
and ``vllm-router``, round robin) for each configuration in turn, the same workload (:mod:`.qa`) against each,
``--repeats`` times in alternation on fresh tiers (every other repeat in reverse order). The configurations are
:data:`CONFIGS` (the command's help lists what each one is)."""

from __future__ import annotations

import argparse
from pathlib import Path

from .qa import Result, Workload, cross_instance, measure, table

#: --launch configurations: launch.sh settings and extra engine arguments
CONFIGS = {
    "recompute": ({"KV": "none", "SHARED": "none"}, "--no-enable-prefix-caching"),
    "prefix-cache": ({"KV": "none", "SHARED": "none"}, ""),
    "tierstore": ({"KV": "tierstore", "SHARED": "none"}, ""),
    "tierstore-shared": ({"KV": "tierstore", "SHARED": "file://{workdir}/shared"}, ""),
    "tierstore-kv-aware": ({"KV": "tierstore", "SHARED": "none", "ROUTER_POLICY": "kv_aware"}, ""),
    "tierstore-serve": ({"KV": "tierstore-serve", "SHARED": "none"}, ""),
    "tierstore-serve-whole": ({"KV": "tierstore-serve", "SHARED": "none",
                               "CONNECTOR_OPTIONS": '"layerwise":false'}, ""),  # loads not overlapped
    "lmcache-mp": ({"KV": "lmcache-mp", "SHARED": "none"}, ""),
    "vllm-fs-tier": ({"KV": "vllm-fs-tier", "SHARED": "file://{workdir}/shared"}, ""),
    "tierstore-tier": ({"KV": "tierstore-tier", "SHARED": "file://{workdir}/shared"}, ""),
    "tierstore-tier-once": ({"KV": "tierstore-tier", "SHARED": "file://{workdir}/shared",
                             "SHARED_OPTIONS": '"verify_reads":"once"'}, ""),
}
#: the configurations of vLLM's offloading with a secondary tier: vLLM's, then ours
TIER_CONFIGS = ("vllm-fs-tier", "tierstore-tier", "tierstore-tier-once")


def launch_names(args: argparse.Namespace) -> list[str]:
    """The configurations of ``--launch``, checked (``SystemExit`` naming what is wrong)."""
    names = [c.strip() for c in args.launch.split(",") if c.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or not names:
        raise SystemExit(f"--launch: unknown configuration(s) {unknown}; choose from {', '.join(CONFIGS)}")
    if len(set(names)) != len(names):
        raise SystemExit("--launch: a configuration is named twice (--repeats runs them again)")
    if args.repeats < 1:
        raise SystemExit("--repeats: at least 1")
    if args.shared is not None and not args.shared.startswith(("file://", "s3://")):
        raise SystemExit(f"--shared: a file:// or s3:// URL, got {args.shared!r}")
    if args.shared and args.shared.startswith("s3://") and "vllm-fs-tier" in names:
        raise SystemExit("--shared: vLLM's fs tier (vllm-fs-tier) needs a file:// directory, not S3")
    return names


def launch_order(names: list[str], rep: int) -> list[str]:
    """The order of repeat ``rep`` (from 0): as given, then reversed, and so on (A B, B A, A B, ...), so that no
    configuration always runs first in its pair, right after the previous one's deployment, or always last."""
    return names if rep % 2 == 0 else names[::-1]


def deployment_env(name: str, args: argparse.Namespace, model: str, state: Path) -> dict[str, str]:
    """``launch.sh``'s settings for configuration ``name`` with its state (and file:// tiers) under ``state``."""
    from ..sizes import parse_size
    from .deploy import CPU_ENGINE_ARGS

    settings, extra = CONFIGS[name]
    env = {k: v.format(workdir=state) for k, v in settings.items()}
    if args.shared is not None and env["SHARED"] != "none":
        env["SHARED"] = args.shared
    try:
        cpu_bytes = parse_size(args.cpu_bytes, key="--cpu-bytes")
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    env.update(MODEL=model, VLLM_CPU_KVCACHE_SPACE=str(args.kv_space), HOST_CAPACITY="4GiB",
               DISK_CAPACITY="16GiB", CPU_BYTES_TO_USE=str(cpu_bytes),
               ENGINE_ARGS=f"{CPU_ENGINE_ARGS} {args.engine_args} {extra}".strip())
    return env


def stored_bytes(shared: str) -> int | None:
    """The bytes of every file under a ``file://`` tier's directory (None for another URL)."""
    if not shared.startswith("file://"):
        return None
    root = Path(shared[len("file://"):])
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) if root.exists() else 0


def launch_and_measure(args: argparse.Namespace, w: Workload, rates: list[float]) -> dict[str, Result]:
    """Each configuration of ``--launch`` in turn on a fresh deployment, ``--repeats`` times in alternation;
    the results by name (the repeats pooled)."""
    import tempfile

    from .deploy import Deployment

    names = launch_names(args)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="tierstore-serve-"))
    model = args.model
    if model is None:
        from tierstore_vllm.bench import build_llama

        heads = max(1, args.hidden // 64)  # head_dim 64: what vLLM's CPU attention supports
        model = str(build_llama(workdir / "model", hidden=args.hidden, layers=args.layers, heads=heads,
                                kv_heads=heads, intermediate=3 * args.hidden))
    results: dict[str, Result] = {}
    for rep in range(args.repeats):
        for name in launch_order(names, rep):
            state = workdir / (name if rep == 0 else f"{name}.{rep}")  # fresh tiers each repeat
            env = deployment_env(name, args, model, state)
            print(f"  serve: {name}{f' (repeat {rep + 1})' if rep else ''}: starting two instances and the "
                  "router ...", flush=True)
            with Deployment(env, state) as dep:
                try:
                    res = measure(dep.url("router"), model, w, rates, [dep.url("a") + "/metrics",
                                                                       dep.url("b") + "/metrics"], args.timeout)
                    res.cross = cross_instance(dep.url("a"), dep.url("b"), model, w, timeout=args.timeout)
                except OSError as exc:  # an engine went away (its /metrics no longer answers)
                    raise SystemExit(f"{name}: {exc}\n{dep.logs()}") from None
            stored = stored_bytes(env["SHARED"])
            res.stored_bytes = [] if stored is None else [stored]
            print(table(res), flush=True)
            if name in results:
                results[name].pool(res)
            else:
                results[name] = res
    return results
