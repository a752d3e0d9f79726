"""What the residency's callers see: the description of a tier, its answers (slots, room, victims,
write-backs, holds) and the markers a copy's generation can carry. No state, no lock."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

from ..keys import ChunkKey

SIZE_BITS = 48
SIZE_MASK = (1 << SIZE_BITS) - 1
#: the generation of a value this process never wrote (found in storage)
UNKNOWN = 0
#: ``busy`` marker of a removal in flight (writes record the generation they write)
REMOVING = -1


NOT_ASIDE = (0.0, 0.0)


def pack(gen: int, size: int) -> int:
    """One int for a copy's generation and size (``size`` itself, no new int, for a copy found in storage)."""
    return gen << SIZE_BITS | size if gen else size

class Pressure(str, enum.Enum):
    """What a full tier does with a dirty victim that no tier below can take now (``on_pressure``)."""

    DROP = "drop"  #: evict it and count it (a cache: KV can be recomputed, weights fetched again)
    KEEP = "keep"  #: keep it; the write that needed the room skips the tier


class Slot(enum.Enum):
    """Answer of :meth:`Residency.begin_write`."""

    OK = "ok"  #: the caller holds the (key, tier) slot: write, then commit or abort
    BUSY = "busy"  #: another mutation of the key at that tier (or a delete) is in flight: wait, ask again
    SUPERSEDED = "superseded"  #: a newer value is there or was put: nothing to write


@dataclass(frozen=True)
class TierSpec:
    """What the control plane knows of a tier: its name, byte budget (``None``: unbounded), whether the store
    writes it, and whether other processes share it (its index is partial: misses are probed)."""

    name: str
    capacity: int | None = None
    writable: bool = True
    shared: bool = False


class Hold(NamedTuple):
    """A copy a read may use: pinned until :meth:`Residency.unpin` (a tuple: one is made per key read)."""

    key: ChunkKey
    tier: int
    size: int
    gen: int


@dataclass(frozen=True)
class Victim:
    """A copy chosen for eviction; its ``(key, tier)`` slot is held for the eviction. ``down``: the tier to
    write it to before it goes (it is dirty), ``None``: it may simply go."""

    key: ChunkKey
    tier: int
    size: int
    gen: int
    down: int | None
    #: whether the pressure policy may drop it when no tier below takes it (not past a chunk being written)
    droppable: bool = True


@dataclass(frozen=True)
class Room:
    """Answer of :meth:`Residency.reserve`: ``reserved`` bytes (granted), else ``victims`` to evict first, else
    ``wait`` (others are freeing room or hold pins), else no room."""

    reserved: int | None = None
    victims: tuple[Victim, ...] = ()
    wait: bool = False


@dataclass(frozen=True)
class Write:
    """A write-back planned by :meth:`Residency.take_due`: copy generation ``gen`` of ``key`` from ``source``
    (pinned) into ``tier`` (whose slot is held)."""

    key: ChunkKey
    tier: int
    gen: int
    source: int
    source_size: int


__all__ = ["REMOVING", "SIZE_BITS", "SIZE_MASK", "UNKNOWN", "Hold", "Pressure", "Room", "Slot", "TierSpec",
           "Victim", "Write", "pack"]
