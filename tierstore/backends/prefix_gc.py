"""Keeping a shared prefix within a budget from its listing alone (``tierstore gc --max-size/--older-than``).

No coordinator and no object is read: a listing gives each object's size and last use (its modification
time, which readers refresh at most once per ``touch_after`` seconds fleet-wide: see
:meth:`FsspecBackend._note_use <tierstore.backends.fsspec.FsspecBackend>`). :func:`plan` is the whole decision:

* temp files (a killed writer's ``*.tso.<hex>.tmp``, a killed publish's ``.publish-*``) older than
  ``stale_after`` (and the grace period) go;
* with ``older_than``, objects last used longer ago go;
* with ``max_size``, the least recently used objects go until the rest fit;
* nothing used (or written) within ``grace`` seconds is ever removed: a writer may be finishing it, a
  reader may hold a listing that names it. The budget can therefore be exceeded by what the grace period
  protects; the plan says by how much.

Several gc processes at once do no harm (a removal of what is already gone is ignored), and a reader
that finds an object gone gets a miss.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ..keys import ChunkKey

#: seconds during which an object written or used is never removed (a writer finishing, a reader's listing)
GRACE_S = 600.0


@dataclass(frozen=True)
class Entry:
    """One file under the prefix: ``key`` is ``None`` for a temp file."""

    path: str
    size: int
    last_use: float  # epoch seconds (0: unknown, treated as recent: never removed for age)
    key: ChunkKey | None = None


@dataclass
class Plan:
    """What :func:`plan` decided: the entries to remove and the budget's state after them."""

    remove: list[Entry] = field(default_factory=list)
    objects: int = 0  # chunk objects listed
    bytes: int = 0  # their bytes
    bytes_after: int = 0  # object bytes left once ``remove`` is done
    protected: int = 0  # objects kept over budget because they were used within the grace period

    @property
    def removed_objects(self) -> int:
        return sum(e.key is not None for e in self.remove)

    @property
    def removed_temp(self) -> int:
        return sum(e.key is None for e in self.remove)


def plan(entries: Iterable[Entry], now: float, *, max_size: int | None = None, older_than: float | None = None,
         grace: float = GRACE_S, stale_after: float = 3600.0) -> Plan:
    """Decide from a listing what to remove (see the module docstring)."""
    result = Plan()
    objects: list[Entry] = []
    for e in entries:
        age = now - e.last_use if e.last_use > 0 else 0.0
        if e.key is None:
            if age > max(stale_after, grace):
                result.remove.append(e)
            continue
        result.objects += 1
        result.bytes += e.size
        if older_than is not None and age > max(older_than, grace):
            result.remove.append(e)
        else:
            objects.append(e)
    kept = sum(e.size for e in objects)
    if max_size is not None and kept > max_size:
        objects.sort(key=lambda e: (e.last_use, e.path))  # least recently used first
        for e in objects:
            if kept <= max_size:
                break
            if e.last_use <= 0 or now - e.last_use <= grace:
                result.protected += 1
                continue
            result.remove.append(e)
            kept -= e.size
    result.bytes_after = kept
    return result
