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


def _check_all(store) -> dict:
    """Read every object of every tier once; corrupt ones are counted and dropped by the tier."""
    result = {}
    for tier in store.tiers:
        keys = tier.keys()
        before = tier.stats()["corrupt"]
        ok = 0
        for i in range(0, len(keys), 64):
            ok += sum(r is not None for r in tier.get_many(keys[i:i + 64]))
        result[tier.name] = {"objects": len(keys), "ok": ok, "corrupt": tier.stats()["corrupt"] - before}
    return result


def run_verify(args) -> int:
    with _open(args) as store:
        result = _check_all(store)
    lines = [f"{name}: {r['objects']} objects, {r['ok']} ok, {r['corrupt']} corrupt (removed)"
             for name, r in result.items()]
    _emit(args, result, lines)
    return 1 if any(r["corrupt"] for r in result.values()) else 0


def add_gc_arguments(p) -> None:
    add_arguments(p)
    p.add_argument("--stale-after", type=float, default=3600.0, metavar="SECONDS",
                   help="remove remote temp files older than this (crashed writers; default 3600)")
    p.add_argument("--older-than", type=float, default=None, metavar="SECONDS",
                   help="also remove remote objects last written longer ago than this, by any writer "
                        "(the age bound of a shared prefix without a bucket lifecycle rule)")


def run_gc(args) -> int:
    # Opening a disk tier already removes its stale temp files (it owns the directory); a shared remote
    # prefix may have live writers, so only old temp files go. Verification drops corrupt objects.
    from .tiers.remote import RemoteTier

    with _open(args) as store:
        result = _check_all(store)
        for tier in store.tiers:
            if isinstance(tier, RemoteTier):
                result[tier.name]["stale_temp_removed"] = tier.remove_stale_temp(args.stale_after)
                if args.older_than is not None:
                    result[tier.name]["expired_removed"] = tier.remove_older_than(args.older_than)
    _emit(args, result, [f"{name}: kept {r['ok']}, removed {r['corrupt'] + r['objects'] - r['ok']}"
                         + (f", {r['stale_temp_removed']} stale temp files" if "stale_temp_removed" in r else "")
                         + (f", {r['expired_removed']} expired objects" if "expired_removed" in r else "")
                         for name, r in result.items()])
    return 0


add_stats_arguments = add_verify_arguments = add_arguments
