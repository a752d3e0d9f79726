"""Outcomes of the data plane's steps that can fail: each says what happened, so no caller mistakes a
failure for "nothing left to do" (a read error for a vanished copy, a failed removal for a removed one).

Plain enums, shared by :mod:`tierstore.transfers` and the parts built on it (write-back, promotion, and any
later mechanism that reserves, fills and commits).
"""

from __future__ import annotations

import enum


class Copied(enum.Enum):
    """Reading a copy to write it elsewhere (a write-down, a promotion): what became of it."""

    SAVED = "saved"  #: the target holds the value now (or a newer one: nothing of this copy left to save)
    GONE = "gone"  #: the source no longer has it, or holds a damaged object: there is nothing to save
    FAILED = "failed"  #: the source could not be read now (an I/O error, no memory): the copy must stay
    REFUSED = "refused"  #: the target did not take it (busy, no room, a write error): try another target


class Eviction(enum.Enum):
    """Carrying out one eviction: whether the victim went."""

    REMOVED = "removed"  #: removed from storage and from the index
    KEPT = "kept"  #: it stays by the rules (a reader pinned it; dirty and nowhere below takes it)
    FAILED = "failed"  #: it could not be saved or removed (an I/O error): set aside for a while, counted


__all__ = ["Copied", "Eviction"]
