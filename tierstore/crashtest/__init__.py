"""``tierstore crashtest``: kill a writer at random moments and check that nothing acknowledged was lost.

In the style of RocksDB's ``db_crashtest``. For each store setup (host+disk, host+disk+file:// remote,
disk+remote; write_back and write_through) a writer process puts, overwrites, reads and flushes chunks and
journals every put and every acknowledgement; the driver SIGKILLs it at a random moment (after a random
delay, inside a ``flush()``, or while it opens the store), then a fresh process opens the same directories
and reads every key from every durable tier. An acknowledged key — ``put`` returned under write_through,
a later ``flush()`` returned without raising under write_back — must hold exactly its last acknowledged
value, or the value of a later put that was not acknowledged (it may have landed before a kill); a key
never acknowledged may also be missing. Anything else is *lost* or *wrong*. Host tiers are volatile:
only disk and remote count.

Modules: :mod:`.journal` (record format and the verdict), :mod:`.worker` (the writer), :mod:`.driver`
(kills, checks, report).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile

from ..cliargs import nonneg_float, positive_float, positive_int
from .driver import COMBOS, SETUPS, CrashTest, format_table
from .worker import SABOTAGE

__all__ = ["COMBOS", "CrashTest", "add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=positive_float, default=None,
                   help="stop after this long (default 1 minute unless --kills is given)")
    p.add_argument("--kills", type=positive_int, default=None, help="stop after this many kills")
    p.add_argument("--configs", default="all", metavar="LIST",
                   help=f"comma-separated setups or setup/policy pairs, from: {', '.join(COMBOS)} (default all)")
    p.add_argument("--dir", default=None, help="work directory (default: a temporary one, removed if all passed)")
    p.add_argument("--seed", type=int, default=None, help="random seed (printed; reuse it to repeat a run)")
    p.add_argument("--keys", type=positive_int, default=48, help="keys per setup (default 48)")
    p.add_argument("--threads", type=positive_int, default=2, help="writer threads (default 2)")
    p.add_argument("--max-delay", type=nonneg_float, default=0.5, metavar="SECONDS",
                   help="longest a writer runs before its kill (default 0.5)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the report as JSON here")
    # a deliberately broken writer, to show the checker catches it (used by the test suite)
    p.add_argument("--sabotage", choices=SABOTAGE, default=None, help=argparse.SUPPRESS)


def _combos(spec: str) -> tuple[str, ...]:
    if spec == "all":
        return COMBOS
    chosen: list[str] = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        matches = [c for c in COMBOS if item in (c, c.split("/")[0])]
        if not matches:
            raise ValueError(f"unknown config {item!r}; known: {', '.join(COMBOS)} or a setup ({', '.join(SETUPS)})")
        chosen += [c for c in matches if c not in chosen]
    return tuple(chosen)


def run(args: argparse.Namespace) -> int:
    """Run the crash test; exit status 1 if anything acknowledged was lost or wrong, or a writer failed."""
    minutes = args.minutes if args.minutes is not None or args.kills is not None else 1.0
    combos = _combos(args.configs)  # before the work directory: a bad --configs leaves nothing behind
    root = args.dir or tempfile.mkdtemp(prefix="tierstore-crashtest-")
    try:
        test = CrashTest(root, combos, seed=args.seed, keys=args.keys, threads=args.threads,
                         max_delay=args.max_delay, sabotage=args.sabotage,
                         progress=lambda line: print(line, file=sys.stderr, flush=True))
    except ValueError:  # the command line prints it in one line
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
        raise
    print(f"crashtest: seed {test.seed}, work directory {root}", file=sys.stderr, flush=True)
    result = test.run(kills=args.kills, seconds=None if minutes is None else minutes * 60)
    print(format_table(result))
    for name, c in result["configs"].items():
        for failure in c["failures"][:5]:
            print(f"{name}: {failure['problem']} {json.dumps(failure)}")
        for error in c["errors"][:5]:
            print(f"{name}: error: {error}")
    print(("PASS" if result["ok"] else "FAIL") + f": {result['kills']} kills, {result['totals']['acked_checked']} "
          f"acknowledged keys checked, {result['totals']['lost']} lost, {result['totals']['wrong']} wrong "
          f"in {result['elapsed_s']:.1f}s" + (" (interrupted)" if result["interrupted"] else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if result["ok"] and args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    elif not result["ok"]:
        print(f"kept {root} (journals, writer logs, the stores) for inspection", file=sys.stderr)
    return 0 if result["ok"] else 1
