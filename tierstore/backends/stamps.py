"""``verify_reads: once`` on a shared mount: the objects this process wrote or verified, as files unchanged since.

A ``remote`` tier on a mount is shared: any process may publish, replace or remove an object at any time. Each
of those changes goes through the file system (a new file linked or renamed into place, an ``unlink``, a
``utime``), so it gives the path another inode or moves the file's change time. This table keeps, per key, the
*stamp* ``(inode, ctime, size)`` of the file as this process last verified it (taken before the read) or wrote
it (taken once it was in place, from its own descriptor), and a digest of its prefix and header. A read whose
file still has that stamp, and whose header still has that digest, needs no checksum over its payload.

A stamp is kept only when a later change is sure to move the ctime (:func:`.file_reads.settled`). What this
does not catch is damage below the file system after the first verified read (a bit flipped in the page cache,
on a medium whose own checks miss it, or on an NFS server), nor an NFS client's attribute cache showing an old
ctime for a while: the same trade as the disk tier's ``verify_reads: once`` (:mod:`.file_reads`).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict

from ..keys import ChunkKey
from .file_reads import PLANS, fine_ctime, head_digest, settled, stamp_of


class Stamps:
    """Per key, the stamp and header digest of the file as this process last verified or wrote it (bounded:
    the :data:`~.file_reads.PLANS` most recent)."""

    def __init__(self, folder: str, limit: int = PLANS):
        self.fine_ctime = fine_ctime(folder)
        self.limit = limit
        self._kept: OrderedDict[ChunkKey, tuple[tuple[int, int, int], bytes]] = OrderedDict()
        self._lock = threading.Lock()

    def trusted(self, key: ChunkKey, st: os.stat_result) -> bytes | None:
        """The header digest a read of ``key``'s file, now stat'ed as ``st``, may skip the checksum for:
        ``None`` unless its stamp is the one kept."""
        kept = self._kept.get(key)  # no lock: one dict lookup
        return kept[1] if kept is not None and kept[0] == stamp_of(st) else None

    def keep(self, key: ChunkKey, st: os.stat_result, head: bytes | memoryview) -> None:
        """``key``'s file, stat'ed as ``st`` (before the read that verified it, or once written and in place),
        has prefix and header ``head``."""
        stamp = settled(stamp_of(st), self.fine_ctime)
        with self._lock:
            self._kept.pop(key, None)
            if stamp is None:
                return
            self._kept[key] = (stamp, head_digest(head))
            while len(self._kept) > self.limit:
                self._kept.popitem(last=False)

    def forget(self, key: ChunkKey) -> None:
        with self._lock:
            self._kept.pop(key, None)
