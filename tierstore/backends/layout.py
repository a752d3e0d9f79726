"""Where a chunk object lives inside a disk directory or remote prefix (shared by both tiers).

``<root>/<first 2 hex digits>/<64 hex digits>.tso`` — 256 fan-out folders keep directories small; the
name alone gives the key back, so an index can be rebuilt by listing. A writer stages an object in a
temp file next to it, ``<64 hex>.tso.<32 hex>.tmp``, and renames or links it into place. Cleanup
removes only names matching these patterns: a directory may hold files that are not ours.
"""

from __future__ import annotations

import re
import uuid

from ..keys import ChunkKey

SUFFIX = ".tso"
TMP_SUFFIX = ".tmp"
#: the temp name a weights publish stages a file in (removed by `tierstore gc` once stale)
PUBLISH_PREFIX = ".publish-"
_TEMP_NAME = re.compile(r"[0-9a-f]{64}\.tso\.[0-9a-f]{32}\.tmp")

#: ``permissions`` setting -> (directory mode, file mode). KV is derived from users' prompts, so the
#: default keeps it to the owner; ``group`` shares a directory with the owner's group.
PERMISSIONS: dict[str, tuple[int, int]] = {"private": (0o700, 0o600), "group": (0o770, 0o660)}


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


def temp_name(key: ChunkKey) -> str:
    """A fresh, unique temp file name for staging ``key``'s object (in the object's own folder)."""
    return f"{key.hex()}{SUFFIX}.{uuid.uuid4().hex}{TMP_SUFFIX}"


def is_temp_name(name: str) -> bool:
    """Whether the last path component is a temp file name :func:`temp_name` makes."""
    return _TEMP_NAME.fullmatch(name.rsplit("/", 1)[-1]) is not None
