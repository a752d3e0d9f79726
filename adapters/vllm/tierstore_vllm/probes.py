"""Existence checks of chunks the store's index does not know, off the scheduler's thread.

vLLM asks a secondary tier about one chunk at a time and requires an answer at once. A chunk another engine
wrote to a shared tier is in no index of ours until a probe of that tier finds it: :class:`Probes` queues such
keys, sends each scheduler step's queue as one batch to a background thread (``flush``), and answers
``None`` ("retry") until the verdict is in. A verdict is kept while a request that asked for it is alive, so
a request asking again every step costs nothing.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field

from tierstore.keys import ChunkKey

log = logging.getLogger("tierstore_vllm")


@dataclass(slots=True)
class _State:
    found: bool | None = None  # None: queued or in flight
    pending: bool = True  # queued or in flight
    requests: set[str] = field(default_factory=set)


class Probes:
    """``ask(chunk keys) -> [held?]`` runs on ``executor``; every other method is for the scheduler's thread."""

    def __init__(self, ask: Callable[[list[ChunkKey]], Sequence[bool]], executor: Executor) -> None:
        self._ask = ask
        self._executor = executor
        self._states: dict[bytes, _State] = {}
        self._by_request: dict[str, set[bytes]] = {}
        self._queued: list[tuple[bytes, ChunkKey]] = []
        self._results: queue.SimpleQueue[tuple[list[bytes], list[bool]]] = queue.SimpleQueue()
        self._batches = 0  # batches sent whose results are not applied yet

    def verdict(self, key: bytes, req_id: str) -> bool | None:
        """The verdict on ``key`` (``None``: none yet, or never asked), recording that ``req_id`` relies on it."""
        self.drain()
        state = self._states.get(key)
        if state is None:
            return None
        self._hold(key, state, req_id)
        return state.found

    def ask(self, key: bytes, chunk: ChunkKey, req_id: str) -> None:
        """Queue ``key`` for the next batch, unless it is queued or in flight already (a slow shared tier must
        not get the same key again every step while its answer is on the way)."""
        state = self._states.get(key)
        if state is None:
            state = self._states[key] = _State()
            self._queued.append((key, chunk))
        self._hold(key, state, req_id)

    def flush(self) -> None:
        """Send this step's queued keys as one batch."""
        self.drain()
        if not self._queued:
            return
        batch, self._queued = self._queued, []
        keys = [k for k, _ in batch]
        chunks = [c for _, c in batch]
        self._batches += 1
        self._executor.submit(self._run, keys, chunks)

    def _run(self, keys: list[bytes], chunks: list[ChunkKey]) -> None:
        try:
            found = [bool(f) for f in self._ask(chunks)]
        except Exception as exc:  # a probe that fails is a miss: the engine recomputes
            log.warning("tierstore: probing %d chunks failed (%s); treated as misses", len(chunks), exc)
            found = [False] * len(chunks)
        self._results.put((keys, found))

    def drain(self) -> None:
        """Apply the verdicts that came back."""
        while True:
            try:
                keys, found = self._results.get_nowait()
            except queue.Empty:
                return
            self._batches -= 1
            for key, hit in zip(keys, found, strict=True):
                state = self._states.get(key)
                if state is None:
                    continue
                state.found, state.pending = hit, False
                if not state.requests:
                    del self._states[key]

    def settle(self, keys: Iterable[bytes], found: bool) -> None:
        """What this engine learnt of ``keys`` itself: a load of them failed (``False``: no request asks to load them
        again) or it stored them (``True``)."""
        for key in keys:
            state = self._states.get(key)
            if state is not None and not state.pending:
                state.found = found

    def release(self, req_id: str) -> None:
        """``req_id`` finished: forget the verdicts no other request relies on (in-flight ones when they land)."""
        for key in self._by_request.pop(req_id, ()):
            state = self._states.get(key)
            if state is None:
                continue
            state.requests.discard(req_id)
            if not state.requests and not state.pending:
                del self._states[key]

    @property
    def busy(self) -> bool:
        """Batches queued or in flight (the engine must keep stepping to see their verdicts)."""
        return bool(self._queued) or self._batches > 0

    def _hold(self, key: bytes, state: _State, req_id: str) -> None:
        state.requests.add(req_id)
        self._by_request.setdefault(req_id, set()).add(key)
