"""``tierstore stats | verify | gc``: inspect and maintain a store from the command line."""

from __future__ import annotations

import json

from .sizes import format_size


def add_arguments(p) -> None:
    p.add_argument("--config", default=None, help="store config (YAML/JSON); default: $TIERSTORE_CONFIG or built-in")
    p.add_argument("--json", default=None, help="also write the result as JSON here")


def _open(args):
    import tierstore

    return tierstore.open(args.config)


def _emit(args, result: dict, lines: list[str]) -> None:
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


def run_stats(args) -> int:
    with _open(args) as store:
        st = store.stats()
    lines = [f"{'tier':<10} {'kind':<7} {'used':>12} {'capacity':>12} {'objects':>8} {'hits':>7} {'misses':>7} "
             f"{'evictions':>9} {'corrupt':>7}"]
    for name, t in st["tiers"].items():
        cap = "unbounded" if t["capacity_bytes"] is None else format_size(t["capacity_bytes"])
        lines.append(f"{name:<10} {t['kind']:<7} {format_size(t['used_bytes']):>12} {cap:>12} {t['objects']:>8} "
                     f"{t['hits']:>7} {t['misses']:>7} {t['evictions']:>9} {t['corrupt']:>7}")
    _emit(args, st, lines)
    return 0


def _check_all(store, repair: bool = False) -> dict:
    """Read every object of every tier once. Damaged objects are removed from private tiers; from shared
    ones (a remote prefix) only with ``repair``. Unsupported ones (newer format, unknown dtype) stay."""
    result = {}
    for tier in store.tiers:
        keys = tier.keys()
        outcomes: list[str] = []
        for i in range(0, len(keys), 64):
            outcomes += tier.verify_many(keys[i:i + 64], repair=repair)
        result[tier.name] = {"objects": len(keys), **{o: outcomes.count(o) for o in
                                                      ("ok", "corrupt", "unsupported", "missing", "error")},
                             "removed": outcomes.count("corrupt") if repair or not tier.shared else 0}
    return result


def add_verify_arguments(p) -> None:
    add_arguments(p)
    p.add_argument("--repair", action="store_true",
                   help="also remove damaged objects from shared (remote) tiers; private tiers always drop them")


def run_verify(args) -> int:
    with _open(args) as store:
        result = _check_all(store, repair=args.repair)
    lines = [f"{name}: {r['objects']} objects, {r['ok']} ok, {r['corrupt']} corrupt ({r['removed']} removed), "
             f"{r['unsupported']} unsupported (kept), {r['error']} unreadable"
             for name, r in result.items()]
    _emit(args, result, lines)
    return 1 if any(r["corrupt"] for r in result.values()) else 0


def add_gc_arguments(p) -> None:
    add_arguments(p)
    p.add_argument("--stale-after", type=float, default=3600.0, metavar="SECONDS",
                   help="remove remote temp files older than this (crashed writers; default 3600)")


def run_gc(args) -> int:
    # Opening a disk tier already removes its stale temp files (it owns the directory); a shared remote
    # prefix may have live writers, so only old temp files go. Verification removes damaged objects
    # everywhere (gc is an explicit repair); unsupported ones stay for the readers that can read them.
    from .tiers.remote import RemoteTier

    with _open(args) as store:
        result = _check_all(store, repair=True)
        for tier in store.tiers:
            if isinstance(tier, RemoteTier):
                result[tier.name]["stale_temp_removed"] = tier.remove_stale_temp(args.stale_after)
    _emit(args, result, [f"{name}: kept {r['objects'] - r['removed']}, removed {r['removed']} damaged"
                         + (f", {r['stale_temp_removed']} stale temp files" if "stale_temp_removed" in r else "")
                         for name, r in result.items()])
    return 0


add_stats_arguments = add_arguments
