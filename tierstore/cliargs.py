"""What the command-line verbs share: argument types that check counts, sizes and durations at parse time, and
errors as one line.

A value out of range is an argparse usage error (one line, exit 2) before any work starts, so a tool that
proves something never runs having checked nothing (``crashtest --kills 0``) and a loop never spins
(``gc --watch 0``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TextIO

from .errors import ConfigError, LockedError
from .sizes import format_size, parse_duration, parse_size


def _number(kind: type[int] | type[float], minimum: float, what: str) -> Callable[[str], int | float]:
    def convert(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not value >= minimum:  # also refuses nan
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return value
    convert.__name__ = what  # argparse names the type in some messages
    return convert


#: an integer >= 1 (a count: keys, kills, threads, rounds, repeats)
positive_int = _number(int, 1, "an integer >= 1")
#: an integer >= 0 (0 turns a part off)
nonneg_int = _number(int, 0, "an integer >= 0")
#: a number > 0 (minutes, a rate)
positive_float = _number(float, 1e-9, "a number > 0")
#: a number >= 0 (a latency, a share)
nonneg_float = _number(float, 0, "a number >= 0")


def size(minimum: int = 1) -> Callable[[str], int]:
    """A byte size as the config takes it (``4096``, ``"4MiB"``) of at least ``minimum`` bytes."""
    def convert(text: str) -> int:
        try:
            n = parse_size(text, key="size")
        except ConfigError:
            raise argparse.ArgumentTypeError(f"cannot parse size {text!r} (use bytes or e.g. '4MiB', '1GB')") from None
        if n < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {format_size(minimum)}, got {text!r}")
        return n
    return convert


def duration(minimum: float = 0.0) -> Callable[[str], float]:
    """A duration as the config takes it (``90``, ``"30m"``, ``"12h"``) of at least ``minimum`` seconds."""
    def convert(text: str) -> float:
        try:
            s = parse_duration(text)
        except ConfigError:
            raise argparse.ArgumentTypeError(f"cannot parse duration {text!r} (use seconds or e.g. '30m', '12h', "
                                             "'7d')") from None
        if s < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum:g} s, got {text!r}")
        return s
    return convert


def one_line(exc: BaseException) -> str:
    """An error as one line for a terminal: what is wrong and, where we know it, how to fix it."""
    if isinstance(exc, OSError) and exc.strerror:
        text = exc.strerror if exc.filename is None else f"{exc.strerror}: {exc.filename!r}"
    else:
        text = str(exc) or type(exc).__name__
    if isinstance(exc, LockedError):  # the library's hint is for Python callers
        text = text.replace("(open it with read_only=True to inspect it)",
                            "(stop that process first; `tierstore stats` and `tierstore verify` work beside it)")
    return " ".join(text.split())


def progress_printer(label: str, unit: str = "", stream: TextIO | None = None) -> Callable[[int, int], None]:
    """A ``progress(done, total)`` callback for a long verb: a bar redrawn in place when ``stream`` (stderr)
    is a terminal, otherwise a plain line at every tenth of the way (logs and pipes stay readable)."""
    out = stream if stream is not None else sys.stderr
    tty = out.isatty()
    shown = -1

    def show(done: int, total: int) -> None:
        nonlocal shown
        pct = 100 if total <= 0 else min(100, done * 100 // total)
        if tty:
            bar = "#" * (pct // 5) + "." * (20 - pct // 5)
            out.write(f"\r{label} [{bar}] {pct:3d}% {done}/{total}{unit}" + ("\n" if done >= total else ""))
            out.flush()
        elif pct // 10 > shown // 10 or (done >= total and shown < 100):
            print(f"{label}: {done}/{total}{unit} ({pct}%)", file=out, flush=True)
        shown = pct
    return show
