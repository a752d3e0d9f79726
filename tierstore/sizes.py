"""Byte sizes and durations as users write them: ``4096``, ``"512MiB"``, ``"1.5 GB"``; ``90``, ``"12h"``."""

from __future__ import annotations

import re

from .errors import ConfigError

_UNITS = {
    "": 1, "B": 1,
    "KB": 1000, "MB": 1000**2, "GB": 1000**3, "TB": 1000**4,
    "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3, "TIB": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_size(value: int | str, *, key: str = "size") -> int:
    """Return ``value`` in bytes.

    Accepts a non-negative int, or a string made of a number and one of B, KB/MB/GB/TB (powers of
    1000) or KiB/MiB/GiB/TiB (powers of 1024). Raises :class:`ConfigError` naming ``key`` otherwise.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a size, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{key}: size must be >= 0, got {value}")
        return value
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m and m.group(2).upper() in _UNITS:
            return int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    raise ConfigError(f"{key}: cannot parse size {value!r} (use bytes or e.g. '512MiB', '32GB')")


def format_size(n: int | float) -> str:
    """Human-readable binary size, e.g. ``4.0 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")


def parse_duration(value: float | str, *, key: str = "duration") -> float:
    """Return ``value`` in seconds: a number (seconds) or a string like ``"90"``, ``"30m"``, ``"12h"``,
    ``"7d"``. Raises :class:`ConfigError` naming ``key`` otherwise."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
        return float(value)
    if isinstance(value, str):
        m = _DURATION_RE.match(value)
        if m:
            return float(m.group(1)) * _DURATION_UNITS[m.group(2)]
    raise ConfigError(f"{key}: cannot parse duration {value!r} (use seconds or e.g. '30m', '12h', '7d')")


def parse_seconds(value: float | str, *, key: str) -> float:
    """A positive, finite duration in seconds, written as the other durations are (``5``, ``0.5``, ``"5s"``,
    ``"30m"``); :class:`ConfigError` naming ``key`` otherwise. Every timeout and interval key takes this."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected positive seconds (e.g. 5, '5s', '2m'), got {value!r}")
    try:
        seconds = parse_duration(value, key=key)
    except ConfigError:
        raise ConfigError(f"{key}: expected positive seconds (e.g. 5, '5s', '2m'), got {value!r}") from None
    if not 0 < seconds < float("inf"):
        raise ConfigError(f"{key}: expected positive seconds (e.g. 5, '5s', '2m'), got {value!r}")
    return seconds
