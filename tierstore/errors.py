"""Exception hierarchy.

Every error tierstore raises on bad input is a :class:`TierstoreError`; each subclass also inherits the
builtin a caller would naturally catch (``KeyError``, ``ValueError`` ...), so ``except ValueError`` keeps
working for code that does not know about tierstore.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .keys import ChunkKey


class TierstoreError(Exception):
    """Base class of every error raised by tierstore."""


class ConfigError(TierstoreError, ValueError):
    """A configuration key or value is invalid; the message names the key."""


class InvalidInputError(TierstoreError, ValueError):
    """An argument has the wrong value (bad tensor, negative size, shape mismatch ...)."""


class InvalidTypeError(TierstoreError, TypeError):
    """An argument has the wrong type (a non-tensor value, a key that is not a ChunkKey ...)."""


class CorruptObjectError(TierstoreError, ValueError):
    """A stored object is damaged: bad magic, header, bounds, checksum or key. Reads treat it as a miss;
    a private tier removes it, a shared one leaves it to ``tierstore verify --repair``."""


class UnsupportedObjectError(TierstoreError, ValueError):
    """A stored object is intact as far as this reader can tell, but it cannot read it: a newer format
    version, or a dtype this torch does not have. A miss, never a delete (another reader may need it)."""


class ForgedObjectError(UnsupportedObjectError):
    """A stored object on a tier with keys that fails authentication: unsealed (when the tier does not read
    legacy objects), sealed with a key id this reader lacks, or a MAC that does not match (altered, or made
    without the key). A miss, counted ``forged``, never a delete (it may be valid in another trust domain)."""


class MissingKeyError(TierstoreError, KeyError):
    """A name or key the caller asked for does not exist."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else ""


class CapacityError(TierstoreError, MemoryError):
    """An object can never fit: it is larger than the tier's capacity."""


class LockedError(TierstoreError, BlockingIOError):
    """A disk tier directory is held by another process."""


class TierTimeoutError(TierstoreError, TimeoutError):
    """An operation did not finish within its deadline."""


class WriteBackError(TierstoreError, OSError):
    """Write-back could not bring some chunks to some tiers.

    ``failed`` maps each such :class:`~tierstore.ChunkKey` to the names of the tiers it did not reach;
    ``dropped`` the chunks the ``drop`` pressure policy gave up since the last flush (not failures).
    """

    def __init__(self, failed: Mapping[ChunkKey, tuple[str, ...]],
                 dropped: Mapping[ChunkKey, tuple[str, ...]] | None = None) -> None:
        self.failed: dict[ChunkKey, tuple[str, ...]] = dict(failed)
        self.dropped: dict[ChunkKey, tuple[str, ...]] = dict(dropped or {})
        shown = ", ".join(f"{k.hex()[:16]}->{'+'.join(v)}" for k, v in list(self.failed.items())[:5])
        more = f" and {len(self.failed) - 5} more" if len(self.failed) > 5 else ""
        super().__init__(f"write-back failed for {len(self.failed)} chunks: {shown}{more}")

    def __str__(self) -> str:  # OSError formats a single argument plainly; keep it that way
        return str(self.args[0])


class ServerUnavailableError(TierstoreError, ConnectionError):
    """A node server (``tierstore serve``) cannot be reached; raised only where a miss would be a lie
    (``flush``)."""


class ClosedError(TierstoreError, RuntimeError):
    """The store or tier has been closed."""


class ForkedError(ClosedError):
    """The store was opened before this process forked: the child must open its own (the store's I/O
    threads did not survive the fork, and its disk directories belong to the parent)."""
