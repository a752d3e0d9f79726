"""Where a chunk object lives inside a disk directory or remote prefix (shared by both tiers).

``<root>/<first 2 hex digits>/<64 hex digits>.tso`` — 256 fan-out folders keep directories small; the
name alone gives the key back, so an index can be rebuilt by listing.
"""

from __future__ import annotations

from ..keys import ChunkKey

SUFFIX = ".tso"
TMP_SUFFIX = ".tmp"


def object_relpath(key: ChunkKey) -> str:
    h = key.hex()
    return f"{h[:2]}/{h}{SUFFIX}"


def key_from_name(name: str) -> ChunkKey | None:
    """The key a file name encodes, or ``None`` for anything that is not a finished object."""
    base = name.rsplit("/", 1)[-1]
    if not base.endswith(SUFFIX) or len(base) != 64 + len(SUFFIX):
        return None
    try:
        return ChunkKey.from_hex(base[:64])
    except ValueError:
        return None
