"""Which disk directory an engine's writer rank took, for the reader ranks of the same engine.

With ``instances: N`` a writer rank takes the first free directory of ``path``, ``path.1`` … (another
engine on the host may hold ``path``), and its reader ranks (MLA: TP rank 0 writes the one copy every rank
reads) must open that same directory, not ``path``: else a second engine's readers read the first
engine's directory and its ranks disagree on every prefix (reliability probe 4.5). The writer *announces*
the directory it got in a small file next to ``path``, under a key its engine's ranks share: their parent
process (the engine's launcher) with that process's start time, so a reused pid is another key. A reader
waits for its writer's announcement (ranks start together) and falls back to ``path`` with a warning if it
never comes (a launcher that does not start the ranks itself). Announcements of launchers that are gone
are removed by the next writer.
"""

from __future__ import annotations

import copy
import logging
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .backends.file import FileBackend
from .store import TieredStore

log = logging.getLogger("tierstore")

#: seconds a reader rank waits for its writer rank's announcement
WAIT_S = 30.0
_NAME = re.compile(r"^[^/\0]+$")


def engine_key(pid: int | None = None) -> str:
    """The key the ranks of one engine share: their parent's pid and start time (``/proc``; pid alone
    elsewhere)."""
    parent = os.getppid() if pid is None else pid
    try:
        with open(f"/proc/{parent}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return f"{parent}-{int(fields[19])}"  # field 22 of stat: the start time, in clock ticks since boot
    except (OSError, IndexError, ValueError):
        return str(parent)


def _note(base: Path, key: str) -> Path:
    return base.parent / f".{base.name}.writer-{key}"


def _disk_bases(config: Mapping[str, Any]) -> list[tuple[int, Path]]:
    return [(i, Path(t["path"])) for i, t in enumerate(config.get("tiers", []))
            if isinstance(t, dict) and t.get("kind") == "disk" and isinstance(t.get("path"), str)]


def announce(config: Mapping[str, Any], store: TieredStore, key: str | None = None) -> None:
    """Record, for each disk tier of ``config``, the directory ``store`` (the writer rank's) opened."""
    key = key or engine_key()
    taken = [Path(t.backend.path).name for t in store.tiers if isinstance(t.backend, FileBackend)]
    for _, base in _disk_bases(config):
        # "" when the writer runs without it (every candidate locked): the readers then need not wait
        name = next((n for n in taken if _one_of(n, base)), "")
        note = _note(base, key)
        _remove_gone(base)
        try:
            tmp = note.with_name(note.name + f".{os.getpid()}.tmp")
            tmp.write_text(name)
            os.replace(tmp, note)
        except OSError as exc:  # the readers fall back to the base directory, with a warning
            log.warning("tierstore: could not tell reader ranks which directory this rank took (%s)", exc)


def follow(config: Mapping[str, Any], key: str | None = None, timeout: float = WAIT_S) -> dict[str, Any]:
    """``config`` (a reader rank's, see :func:`~tierstore.engines.rank_config`) with each disk tier's path
    replaced by the directory its writer rank announced; waits up to ``timeout`` seconds for it."""
    key = key or engine_key()
    out = copy.deepcopy(dict(config))
    deadline = time.monotonic() + timeout
    for i, base in _disk_bases(out):
        note = _note(base, key)
        name = _read_when_there(note, deadline)
        if name is None:
            log.warning("tierstore: no writer rank of this engine announced its directory within %.0fs; "
                        "reading %s", timeout, base)
            continue
        if not name:
            log.warning("tierstore: this engine's writer rank runs without %s; reading it anyway", base)
            continue
        if not _NAME.match(name) or not _one_of(name, base):
            log.warning("tierstore: ignoring a malformed writer announcement %s", note)
            continue
        out["tiers"][i]["path"] = str(base.parent / name)
        (base.parent / name).mkdir(mode=0o700, parents=True, exist_ok=True)
    return out


def _one_of(name: str, base: Path) -> bool:
    """Whether ``name`` is one of the directories ``instances`` picks from: ``base`` or ``base.<i>``."""
    return name == base.name or name.startswith(base.name + ".")


def _read_when_there(note: Path, deadline: float) -> str | None:
    """``note``'s text once it exists, ``None`` if it does not by ``deadline`` (``time.monotonic``)."""
    while True:
        try:
            return note.read_text().strip()
        except FileNotFoundError:
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)


def _remove_gone(base: Path) -> None:
    """Remove announcements next to ``base`` whose launcher is no longer running."""
    prefix = f".{base.name}.writer-"
    try:
        entries = list(os.scandir(base.parent))
    except OSError:
        return
    for e in entries:
        if not e.name.startswith(prefix) or e.name.endswith(".tmp"):
            continue
        key = e.name[len(prefix):]
        pid = key.split("-", 1)[0]
        if pid.isdigit() and engine_key(int(pid)) != key:  # gone, or its pid now another process's
            try:
                os.unlink(e.path)
            except OSError:
                pass
