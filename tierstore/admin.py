"""``tierstore stats | verify | gc``: inspect and maintain a store, also beside the engine that owns it.

The verbs open only the persistent tiers of the config (a host or device tier is one process's memory:
there is nothing to inspect from outside, and allocating it would cost RAM). Every directory a disk tier
may use is included (``path``, and ``path.1`` … with ``instances``).

* ``stats`` and ``verify`` open disk directories read-only, without the lock, so they work while an
  engine owns them; they never remove anything. ``verify`` reads every object and reports the bad ones.
* ``verify --repair`` and ``gc`` remove: corrupt objects (``verify --repair``), plus our crashed writers'
  temp files (``gc``: on disk when a directory is opened for writing; on a remote, those older than
  ``--stale-after``). They need every disk directory unlocked and refuse, removing nothing, while a
  process holds one; ``gc --tier remote`` opens only that tier, so it runs beside a live engine. On a
  shared remote prefix they remove only what is corrupt or ours and stale, and with ``gc --older-than``
  chunk objects past that age, whoever wrote them.
  Unsupported objects (a newer format, a dtype this torch lacks) and forged ones (a tier with keys could
  not open them) are reported and always kept.

Exit status: 0 all well, 1 corrupt or forged objects were found, 2 refused (a directory is in use).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .backends import prefix_gc
from .cliargs import duration, one_line, progress_printer, size
from .errors import ConfigError, CorruptObjectError, ForgedObjectError, LockedError, UnsupportedObjectError
from .sizes import format_size

if TYPE_CHECKING:
    from .backends.base import Backend

#: objects read per batch while verifying
_BATCH = 64
#: the shortest ``gc --watch`` interval: each pass lists the whole prefix (on S3, LIST requests)
WATCH_MIN_S = 1.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="store config (YAML/JSON); default: $TIERSTORE_CONFIG or built-in")
    p.add_argument("--json", default=None, help="also write the result as JSON here")


def add_verify_arguments(p: argparse.ArgumentParser) -> None:
    add_arguments(p)
    p.add_argument("--repair", action="store_true",
                   help="remove corrupt objects (needs every disk directory unlocked: stop the engine first)")


def add_gc_arguments(p: argparse.ArgumentParser) -> None:
    add_arguments(p)
    p.add_argument("--max-size", type=size(0), default=None, metavar="SIZE",
                   help="keep each remote prefix under SIZE (e.g. 500GiB): least recently used objects go "
                        "first; decided from listings only, no object is read")
    p.add_argument("--older-than", type=duration(), default=None, metavar="AGE",
                   help="remove remote objects last used longer ago than AGE (seconds, or 30m, 12h, 7d)")
    p.add_argument("--grace", type=duration(), default=prefix_gc.GRACE_S, metavar="AGE",
                   help="never remove what was written or used more recently than this (default 600 s: a "
                        "writer may be finishing, a reader may hold a listing naming it)")
    p.add_argument("--stale-after", type=duration(), default=3600.0, metavar="AGE",
                   help="remove remote temp files (crashed writers, killed publishes) older than this "
                        "(default 3600 s)")
    p.add_argument("--tier", action="append", default=None, metavar="NAME",
                   help="only this tier of the config (repeatable), e.g. --tier remote: a sidecar beside a live "
                        "engine opens only the shared tier, never the engine's locked disk directories")
    p.add_argument("--watch", type=duration(WATCH_MIN_S), default=None, metavar="INTERVAL",
                   help=f"run again every INTERVAL (at least {WATCH_MIN_S:g} s) until interrupted (a sidecar "
                        "keeping the budget)")
    p.add_argument("--prometheus", default=None, metavar="FILE",
                   help="after each pass, write its figures per remote tier (tierstore_gc_*) atomically to FILE "
                        "for a node exporter's textfile collector")


def add_stats_arguments(p: argparse.ArgumentParser) -> None:
    add_arguments(p)
    p.add_argument("--prometheus", nargs="?", const="-", default=None, metavar="FILE",
                   help="print the Prometheus text format instead of the table, or write it atomically to FILE "
                        "(a node exporter's textfile collector, e.g. /var/lib/node_exporter/tierstore.prom)")


@dataclass
class Persistent:
    """A persistent tier of the config opened for inspection: its name, kind, capacity and backend."""

    name: str
    kind: str
    capacity: int | None
    backend: Backend
    read_only: bool = False


@contextmanager
def open_persistent_tiers(config: Any, writable: bool, only: Sequence[str] | None = None
                          ) -> Iterator[list[Persistent]]:
    """The config's disk (each directory it may use) and remote tiers, closed on exit; with ``only``, just
    the tiers of those names (an unknown name is a :class:`ConfigError`), the others never opened.

    ``writable=False`` opens disk directories read-only without their lock. ``writable=True`` takes
    each lock and raises :class:`LockedError` (after closing what it opened) if a process holds one.
    """
    from .backends.file import FileBackend
    from .backends.fsspec import FsspecBackend
    from .config import parse_config

    cfg = parse_config(config)
    if only is not None:
        unknown = set(only) - {tc.name for tc in cfg.tiers}
        if unknown:
            raise ConfigError(f"no tier named {', '.join(sorted(unknown))} in the config "
                              f"(tiers: {', '.join(tc.name for tc in cfg.tiers)})")
    with ExitStack() as stack:
        tiers: list[Persistent] = []
        for tc in cfg.tiers:
            if only is not None and tc.name not in only:
                continue
            if tc.kind == "disk":
                opts = {k: v for k, v in tc.options.items() if k not in ("instances", "capacity")}
                base = opts.pop("path")
                owned_read_only = tc.options.get("read_only", False)
                for i in range(tc.options.get("instances", 1)):
                    path = base if i == 0 else f"{base}.{i}"
                    if os.path.isdir(path):
                        opts["read_only"] = owned_read_only or not writable
                        name = tc.name if i == 0 else f"{tc.name}.{i}"
                        tiers.append(Persistent(name, "disk", tc.options.get("capacity"),
                                                stack.enter_context(FileBackend(name=name, path=path, **opts)),
                                                read_only=owned_read_only))
            elif tc.kind == "remote":
                tiers.append(Persistent(tc.name, "remote", None,
                                        stack.enter_context(FsspecBackend(name=tc.name, **tc.options))))
        yield tiers


def _emit(args: argparse.Namespace, result: dict[str, Any], lines: list[str]) -> None:
    if not result or result == {"tiers": {}}:
        lines = ["no disk or remote tier in this config (a host or device tier is one process's memory: there "
                 "is nothing to inspect from outside)"]
    print("\n".join(lines), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


def _refuse(exc: LockedError, verb: str) -> int:
    print(f"tierstore {verb}: refused, nothing removed: {one_line(exc)}", file=sys.stderr)
    return 2


def tier_stats(tier: Persistent) -> dict[str, Any]:
    """What ``tierstore stats`` shows of one tier, from a listing of its storage."""
    listed = list(tier.backend.list())
    return {"kind": tier.kind, "objects": len(listed), "used_bytes": sum(f.size for f in listed),
            "capacity_bytes": tier.capacity, **tier.backend.stats()}


def run_stats(args: argparse.Namespace) -> int:
    with open_persistent_tiers(args.config, writable=False) as tiers:
        st = {"tiers": {t.name: tier_stats(t) for t in tiers}}
    if args.prometheus is not None:
        from .metrics import StoreCollector, exposition, write_textfile

        collector = StoreCollector(lambda: st)
        if args.prometheus == "-":
            sys.stdout.write(exposition(collector).decode())
        else:
            write_textfile(args.prometheus, collector)
        return 0
    lines = [f"{'tier':<10} {'kind':<7} {'objects':>8} {'used':>12} {'capacity':>12}  location"]
    for name, t in st["tiers"].items():
        cap = "unbounded" if t["capacity_bytes"] is None else format_size(t["capacity_bytes"])
        lines.append(f"{name:<10} {t['kind']:<7} {t['objects']:>8} {format_size(t['used_bytes']):>12} {cap:>12}  "
                     f"{t.get('path') or t.get('url', '')}")
    _emit(args, st, lines)
    return 0


def check_objects(tier: Persistent, repair: bool,
                  progress: Callable[[int, int], None] | None = None) -> dict[str, int]:
    """Read every object of ``tier`` once: counts of ``ok``, ``corrupt``, ``unsupported`` (a newer format
    or a dtype this torch lacks: always kept, a newer reader needs it), ``forged`` (a tier with keys could
    not open it: always kept, it may belong to another trust domain), ``missing`` (vanished since
    listed) and ``unreadable`` (I/O errors: not judged). With ``repair`` corrupt objects are deleted (not
    from a disk directory the config marks ``read_only``: it belongs to someone else, nor from a view
    opened read-only)."""
    backend = tier.backend
    repair = repair and not tier.read_only and backend.capabilities.writable
    keys = [f.key for f in backend.list()]
    counts = {"objects": len(keys), "ok": 0, "corrupt": 0, "unsupported": 0, "forged": 0, "missing": 0,
              "unreadable": 0, "removed": 0}
    for i in range(0, len(keys), _BATCH):
        batch = keys[i:i + _BATCH]
        corrupt = []
        for key, got in zip(batch, backend.read_objects(batch), strict=True):
            outcome = _outcome(got)
            counts[outcome] += 1
            if outcome == "corrupt":
                corrupt.append(key)
        if repair and corrupt:
            counts["removed"] += sum(err is None for err in backend.delete_many(corrupt))
        if progress is not None:
            progress(i + len(batch), len(keys))
    return counts


def _outcome(got: Any) -> str:
    """``ok``, ``missing``, ``corrupt``, ``forged``, ``unsupported`` or ``unreadable`` for one object read."""
    if got is None or isinstance(got, FileNotFoundError):
        return "missing"
    if isinstance(got, ForgedObjectError):
        return "forged"
    if isinstance(got, UnsupportedObjectError):
        return "unsupported"
    if isinstance(got, CorruptObjectError):
        return "corrupt"
    if isinstance(got, BaseException):
        return "unreadable"
    try:
        got.value.header.require_supported()  # a dtype this torch lacks: only decoding would find it
    except UnsupportedObjectError:
        return "unsupported"
    return "ok"


def run_verify(args: argparse.Namespace) -> int:
    try:
        with open_persistent_tiers(args.config, writable=args.repair) as tiers:
            result = {t.name: check_objects(t, repair=args.repair,
                                            progress=progress_printer(f"verify {t.name}", " objects"))
                      for t in tiers}
    except LockedError as exc:
        return _refuse(exc, "verify --repair")
    lines = [f"{name}: {r['objects']} objects, {r['ok']} ok, {r['corrupt']} corrupt"
             + (f" ({r['removed']} removed)" if args.repair else " (kept; --repair removes them)" if r["corrupt"]
                else "")
             + (f", {r['unsupported']} unsupported (kept)" if r["unsupported"] else "")
             + (f", {r['forged']} forged (kept)" if r["forged"] else "")
             + (f", {r['unreadable']} unreadable" if r["unreadable"] else "")
             for name, r in result.items()]
    _emit(args, result, lines)
    return 1 if any(r["corrupt"] or r["forged"] for r in result.values()) else 0


def run_gc(args: argparse.Namespace) -> int:
    """Disk directories (each needs its lock: no engine may own it) are checked and repaired, and opening
    one for writing removes its stale temp files. A shared remote prefix may have live writers and readers:
    it is kept within ``--max-size`` / ``--older-than`` from one listing (no object read: ``verify`` does
    that), and only temp files older than ``--stale-after`` go. With ``--watch`` a pass that fails (the
    storage unreachable) is reported and counted, and the next one runs on time."""
    failed = 0
    result: dict[str, dict[str, Any]] = {}
    while True:
        try:
            code, result = _gc_pass(args)
        except OSError as exc:
            if args.watch is None:
                raise
            failed += 1
            code = 0
            print(f"tierstore gc: pass failed ({type(exc).__name__}: {exc}); next in {args.watch:g}s",
                  file=sys.stderr, flush=True)
        if args.prometheus:
            from .metrics import GcCollector, write_textfile

            shown = {n: {**r, "failed_passes": failed} for n, r in result.items() if "bytes_after" in r}
            write_textfile(args.prometheus, GcCollector(shown))
        if args.watch is None or code:
            return code
        time.sleep(args.watch)


def _gc_pass(args: argparse.Namespace) -> tuple[int, dict[str, dict[str, Any]]]:
    from .backends.fsspec import FsspecBackend

    result: dict[str, dict[str, Any]] = {}
    lines = []
    try:
        with open_persistent_tiers(args.config, writable=True, only=args.tier) as tiers:
            for tier in tiers:
                if isinstance(tier.backend, FsspecBackend):
                    started = time.monotonic()
                    done = tier.backend.collect_garbage(max_size=args.max_size, older_than=args.older_than,
                                                grace=args.grace, stale_after=args.stale_after)
                    r = result[tier.name] = {
                        "objects": done.objects, "bytes": done.bytes, "removed_objects": done.removed_objects,
                        "removed_bytes": done.bytes - done.bytes_after, "bytes_after": done.bytes_after,
                        "stale_temp_removed": done.removed_temp, "protected_by_grace": done.protected,
                        "seconds": time.monotonic() - started, "finished": time.time()}
                    budget = "" if args.max_size is None else f" (budget {format_size(args.max_size)}" + (
                        f", {r['protected_by_grace']} used within the grace period kept over it)"
                        if r["protected_by_grace"] else ")")
                    lines.append(f"{tier.name}: {r['objects']} objects, {format_size(r['bytes'])}; removed "
                                 f"{r['removed_objects']} objects ({format_size(r['removed_bytes'])}), "
                                 f"{r['stale_temp_removed']} stale temp files; {format_size(r['bytes_after'])} "
                                 f"left{budget}")
                else:
                    r = result[tier.name] = check_objects(
                        tier, repair=True, progress=progress_printer(f"gc {tier.name}", " objects"))
                    lines.append(f"{tier.name}: kept {r['ok']}, removed {r['removed']} corrupt")
    except LockedError as exc:
        return _refuse(exc, "gc"), {}
    _emit(args, result, lines)
    return 0, result
