"""Range planning: which byte ranges to read, in how many pieces, and which tensors each one feeds.

Tensors of a shard are packed, in file order, into *groups* of at most ``block_size`` bytes (a larger
tensor forms a group of its own); a group is the unit of landing memory and of delivery — its tensors
are yielded together once every byte of it is in. Each group is read as one or more *pieces* of at most
``block_size`` bytes (4 KiB-aligned sizes), the unit of I/O, of concurrency and of range caching.

Without a cache, only selected tensors are packed and gaps (unselected tensors) split groups, so a subset
load reads only what it needs. With a cache, groups are formed over *every* tensor of the shard so the
pieces — and hence the cache keys — are the same whatever subset is loaded. A shard whose digest is
checked is read *complete* (every byte, in groups that may hold no selected tensor) once any of its tensors
is selected.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass

from .header import TensorInfo

ALIGN = 4096


@dataclass(frozen=True)
class Piece:
    """Bytes ``[start, end)`` of a shard, read in one request."""

    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Group:
    """A span ``[start, end)`` of shard ``shard`` holding ``tensors`` (the selected ones) whole."""

    shard: int
    start: int
    end: int
    tensors: tuple[TensorInfo, ...]
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def split(start: int, end: int, block_size: int) -> tuple[Piece, ...]:
    """Cut ``[start, end)`` into the fewest near-equal pieces of at most ``block_size`` bytes."""
    length = end - start
    if length <= 0:
        return ()
    n = -(-length // block_size)
    step = -(-length // n)
    if n > 1:
        step = min(-(-step // ALIGN) * ALIGN, block_size) if block_size >= ALIGN else step
        n = -(-length // step)
    return tuple(Piece(start + k * step, min(end, start + (k + 1) * step)) for k in range(n))


def plan_shard(shard: int, tensors: tuple[TensorInfo, ...], selected: Container[str], block_size: int,
               whole: bool, complete: bool = False) -> list[Group]:
    """Groups for one shard; ``tensors`` in file order, ``selected`` a set of names.

    Args:
        whole: pack every tensor (cache-friendly, subset-independent pieces) rather than only selected.
        complete: read every byte of the shard if any of its tensors is selected.
    """
    groups: list[Group] = []
    members: list[TensorInfo] = []
    if complete:
        if not any(t.name in selected for t in tensors):
            return groups
        whole = True

    def close() -> None:
        chosen = tuple(t for t in members if t.name in selected)
        if chosen or (complete and members):
            start, end = members[0].start, members[-1].end
            groups.append(Group(shard, start, end, chosen, split(start, end, block_size)))
        members.clear()

    for t in tensors:
        if not whole and t.name not in selected:
            close()
            continue
        if members and (t.end - members[0].start > block_size or t.start != members[-1].end):
            close()
        members.append(t)
    close()
    return groups


def plan(shard_tensors: list[tuple[TensorInfo, ...]], selected: Container[str], block_size: int,
         whole: bool, complete: Container[int] = ()) -> list[Group]:
    """Groups of every shard, shard by shard, in file order; shards in ``complete`` are read whole."""
    out: list[Group] = []
    for i, tensors in enumerate(shard_tensors):
        out.extend(plan_shard(i, tensors, selected, block_size, whole, i in complete))
    return out
