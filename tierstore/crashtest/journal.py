"""The crash test's journal: what a writer did and was told, and the verdict on what survived a kill.

A writer appends one JSON record per line to ``journal.jsonl`` (tensors never; only key hexes and content
digests). Every incarnation of the writer appends to the same file, so it is the whole history of a
store directory:

``{"op": "put", "seq": 7, "key": KEY, "digest": D}``
    written before ``store.put`` is called (``seq`` grows across incarnations);
``{"op": "flush", "t": 0}``
    writer thread 0 calls ``flush()``;
``{"op": "ack", "t": 0, "seqs": [5, 7]}``
    these puts are acknowledged: ``put`` returned (write_through), or a ``flush()`` that thread ``t``
    called after them returned without raising (write_back); appended and fsynced;
``{"op": "flush_failed", "t": 0, "error": "..."}``
    ``flush()`` raised: the puts it would have acknowledged never are;
``{"op": "dropped", "t": 0, "seqs": [S, ...]}``
    the flush reported these puts dropped by the drop policy: they are not acknowledged;
``{"op": "wrong", "key": KEY, "digest": D, "expected": D2}``
    a live ``get`` returned other bytes than the writer's last put of that key;
``{"op": "error", "error": "..."}``
    the writer stopped on an unexpected exception.

A SIGKILL can tear the last line; a reader skips a line it cannot parse, and a writer that opens a journal
whose last line has no newline ends it first, so the next record starts on a line of its own.

What may survive for a key (:meth:`Journal.allowed`): its last acknowledged value, or the value of any put
after that one (in flight at some kill, so it may or may not have landed). A key with no acknowledged put
may also be missing. Anything else — an older value, bytes never put, a torn object read as data — is wrong.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

#: observed value of a key in one place: a content digest, or ``None`` (missing)
Observed = dict[str, str | None]


class JournalWriter:
    """Appends records to a journal file; safe to share between threads (one ``write`` per record)."""

    def __init__(self, path: str):
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            torn = size > 0 and os.pread(f.fileno(), 1, size - 1) != b"\n"
        if torn:
            os.write(self._fd, b"\n")  # the previous writer was killed mid-record

    def append(self, record: dict[str, Any], sync: bool = False) -> None:
        """Append ``record``; with ``sync``, fsync it (and everything before it) before returning."""
        os.write(self._fd, json.dumps(record, separators=(",", ":")).encode() + b"\n")
        if sync:
            os.fsync(self._fd)

    def close(self) -> None:
        os.close(self._fd)


@dataclass
class Verdict:
    """One check of every key after a kill."""

    checked: int = 0  #: keys with an acknowledged put, each checked in every place it must be
    lost: int = 0  #: acknowledged keys missing from at least one such place
    wrong: int = 0  #: keys holding a value they may not hold, in any place
    failures: list[dict[str, Any]] = field(default_factory=list)


class Journal:
    """The reader's model of a journal, brought up to date by :meth:`refresh` (reads only new lines)."""

    def __init__(self, path: str):
        self.path = path
        self.puts: dict[str, list[tuple[int, str]]] = {}  # key -> [(seq, digest)] in seq order
        self.acked: set[int] = set()
        self.last_seq = 0
        self.torn = 0  #: unparsable lines (records cut by a kill)
        self.flush_failures = 0
        self.dropped = 0
        self.live_wrong: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self.open_flushes: set[int] = set()  #: writer threads inside flush() as of the last record read
        self._offset = 0

    def refresh(self) -> None:
        """Read the records appended since the last call (complete lines only)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1
        self._offset += end
        for line in data[:end].splitlines():
            try:
                record = json.loads(line)
                self._apply(record)
            except (ValueError, KeyError, TypeError):
                self.torn += bool(line.strip())

    def _apply(self, r: dict[str, Any]) -> None:
        op = r["op"]
        if op == "put":
            self.puts.setdefault(r["key"], []).append((int(r["seq"]), str(r["digest"])))
            self.last_seq = max(self.last_seq, int(r["seq"]))
        elif op == "ack":
            self.acked.update(int(s) for s in r["seqs"])
            self.open_flushes.discard(r["t"])
        elif op == "flush":
            self.open_flushes.add(r["t"])
        elif op == "flush_failed":
            self.flush_failures += 1
            self.open_flushes.discard(r["t"])
        elif op == "dropped":
            self.dropped += len(r["seqs"])
        elif op == "wrong":
            self.live_wrong.append(r)
        elif op == "error":
            self.errors.append(str(r["error"]))
        else:
            raise KeyError(op)

    def new_incarnation(self) -> None:
        """A new writer starts: no thread of it is inside ``flush()`` yet."""
        self.open_flushes.clear()

    def allowed(self, key: str) -> tuple[bool, set[str | None]]:
        """``(acknowledged, values the key may hold)``; ``None`` in the set means it may be missing."""
        history = sorted(self.puts.get(key, ()))
        last_ack = max((i for i, (seq, _) in enumerate(history) if seq in self.acked), default=-1)
        values: set[str | None] = {digest for _, digest in history[max(last_ack, 0):]}
        if last_ack < 0:
            values.add(None)
        return last_ack >= 0, values

    def judge(self, observed: dict[str, Observed], required: list[str]) -> Verdict:
        """Check every key of the journal against what a fresh process read from each durable tier.

        ``observed`` maps each durable tier, in store order, to the digest it holds per key; the store's
        answer is the first tier holding the key (what ``get`` returns). An acknowledged key must be
        present in the store's answer and in every tier named in ``required`` (the tiers that never
        evict in this setup). Any value present anywhere must be one the key may hold.
        """
        verdict = Verdict()
        for key in sorted(self.puts):
            acked, values = self.allowed(key)
            places = {tier: found.get(key) for tier, found in observed.items()}
            places = {"store": next((d for d in places.values() if d is not None), None), **places}
            lost = acked and any(places[p] is None for p in ["store", *required])
            bad = {p: d for p, d in places.items() if d is not None and d not in values}
            verdict.checked += acked
            verdict.lost += lost
            verdict.wrong += bool(bad)
            if lost or bad:
                verdict.failures.append({
                    "key": key, "acknowledged": acked, "may_hold": sorted(v or "missing" for v in values),
                    "found": {p: d or "missing" for p, d in places.items()},
                    "problem": ", ".join(name for name, hit in (("lost", lost), ("wrong", bad)) if hit)})
        return verdict
