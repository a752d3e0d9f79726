"""The connector's scheduler half: how many prompt tokens the workers can load, and each step's plan.

It holds no store. The workers' stores answer lookups over :mod:`.lookup`; this side only caches each
request's answer until the request is scheduled (``README.md``, "Who knows what is cached").
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .plan import LoadSpec, SaveSpec, StepPlan

log = logging.getLogger("tierstore_vllm")

Ask = Callable[[dict[str, Any]], list[dict[str, Any]]]


@dataclass
class _Lookup:
    """One request's lookup: in flight, or answered (``hit`` tokens every rank can load now)."""

    future: concurrent.futures.Future[list[dict[str, Any]]]
    first_asked: float
    num_computed: int = 0
    hit: int | None = None


@dataclass
class _Tracked:
    """A scheduled request: its blocks and how far its tokens (prompt, then decoded) are saved."""

    prompt: list[int]
    block_ids: list[int]
    tenant: str | None
    stored: int  # leading tokens the store holds (no need to save them again)
    request: Any = None  # vLLM's live Request (its all_token_ids grows as tokens are decoded)


@dataclass
class Stored:
    """Blocks a save puts in the store, for a KV event (``TierstoreConnector.take_events``): vLLM's own hashes
    of them, the hash of the block before them (``None``: they start the prompt) and their tokens."""

    block_hashes: list[Any]
    parent: Any
    token_ids: list[int]


def tenant_of(request: Any) -> str | None:
    """The request's tenant: vLLM's ``cache_salt`` when set (requests with a salt share only among
    themselves, as in vLLM's own prefix cache)."""
    salt = getattr(request, "cache_salt", None)
    return salt if isinstance(salt, str) and salt else None


class SchedulerSide:
    """Answers vLLM's scheduler callbacks.

    ``ask`` sends one lookup to every worker rank and returns their replies (``{"ready": tokens,
    "pending": bool}`` each); it runs on one background thread, so the scheduler never blocks on it for
    more than ``lookup_timeout_s``.
    """

    def __init__(self, ask: Ask, *, chunk_tokens: int, block_size: int, lookup_timeout_s: float,
                 remote_wait_s: float, events: bool = False):
        self._ask = ask
        self.events = events  # note what each save stores, for vLLM's KV events (routers)
        self._stored: list[Stored] = []
        self.chunk_tokens = chunk_tokens
        self.block_size = block_size
        self.lookup_timeout_s = lookup_timeout_s
        self.remote_wait_s = remote_wait_s
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tierstore-vllm-lookup")
        self._lookups: dict[str, _Lookup] = {}
        self._tracked: dict[str, _Tracked] = {}
        self._loads: list[LoadSpec] = []
        # live Request objects until scheduled: the scheduler output carries neither their cache_salt (tenant)
        # nor their decoded tokens (saved by chunk)
        self._requests: dict[str, Any] = {}
        self._warned = False
        self.counters = dict.fromkeys(("lookups", "ask_again", "hit_tokens", "lookup_errors", "loads",
                                       "saves"), 0)
        self.lookup_seconds = 0.0

    # ------------------------------------------------------------------ lookups
    def _limit(self, prompt: Sequence[int]) -> int:
        """Tokens a hit may cover: whole chunks, and never the whole prompt (vLLM computes >= 1 token)."""
        return (max(len(prompt) - 1, 0) // self.chunk_tokens) * self.chunk_tokens

    def _submit(self, prompt: Sequence[int], limit: int, tenant: str | None,
                again: bool = False) -> concurrent.futures.Future[list[dict[str, Any]]]:
        # "asked": prompt tokens the workers count for the token hit rate (once per request, not per re-ask)
        request = {"tokens": list(prompt[:limit]), "tenant": tenant, "asked": 0 if again else len(prompt)}

        def run() -> list[dict[str, Any]]:
            t0 = time.perf_counter()
            try:
                return self._ask(request)
            finally:
                self.lookup_seconds += time.perf_counter() - t0

        self.counters["lookups"] += 1
        return self._pool.submit(run)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """``(tokens beyond num_computed_tokens the workers can load now, False)``, or ``(None, False)``
        while the answer is not in yet ("ask again"). Loads are synchronous: the chunks counted are
        already in the workers' local tiers. Calling it again changes nothing vLLM can see."""
        rid = request.request_id
        self._requests[rid] = request
        prompt = request.prompt_token_ids
        limit = self._limit(prompt)
        if limit <= num_computed_tokens:
            return 0, False
        state = self._lookups.get(rid)
        now = time.monotonic()
        if state is None:
            state = self._lookups[rid] = _Lookup(self._submit(prompt, limit, tenant_of(request)), now)
        state.num_computed = num_computed_tokens
        if state.hit is None:
            try:
                replies = state.future.result(timeout=self.lookup_timeout_s)
            except concurrent.futures.TimeoutError:
                if now - state.first_asked < self.remote_wait_s:
                    self.counters["ask_again"] += 1
                    return None, False
                state.hit = 0  # the workers did not answer in time: schedule without the cache
            except Exception as exc:
                self._lookup_failed(exc)
                state.hit = 0
            else:
                pending = any(r.get("pending") for r in replies)
                if pending and now - state.first_asked < self.remote_wait_s:
                    state.future = self._submit(prompt, limit, tenant_of(request), again=True)  # re-ask next step
                    self.counters["ask_again"] += 1
                    return None, False
                state.hit = self._combine(replies, limit)
        new = max(0, state.hit - num_computed_tokens)
        return new, False

    def _combine(self, replies: list[dict[str, Any]], limit: int) -> int:
        """Tokens every rank can load: the minimum of their answers, cut to whole chunks."""
        errors = [r["error"] for r in replies if "error" in r]
        if errors:
            self._lookup_failed(RuntimeError(errors[0]))
            return 0
        ready = min(int(r.get("ready", 0)) for r in replies)
        return min(limit, ready - ready % self.chunk_tokens)

    def _lookup_failed(self, exc: BaseException) -> None:
        self.counters["lookup_errors"] += 1
        if not self._warned:
            self._warned = True
            log.warning("tierstore: worker lookup failed (%r); requests are computed without the cache", exc)

    def update_state_after_alloc(self, request: Any, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """Record the load of ``num_external_tokens`` tokens into ``block_ids`` (the request's block table
        from token 0) for the next plan."""
        state = self._lookups.get(request.request_id)
        if num_external_tokens <= 0 or state is None:
            return
        start = state.num_computed
        end = start + num_external_tokens
        self._loads.append(LoadSpec(request.request_id, list(request.prompt_token_ids[:end]), start,
                                    list(block_ids), tenant_of(request)))
        self.counters["loads"] += 1
        self.counters["hit_tokens"] += num_external_tokens

    # ------------------------------------------------------------------ per step
    def build_plan(self, scheduler_output: Any) -> StepPlan:
        """This step's loads (recorded since the last step) and the saves of prompts whose prefill
        completes in this step. Reads ``scheduler_output``, never changes it."""
        plan = StepPlan(loads=self._loads)
        self._loads = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._lookups.get(new.req_id)
            prompt = list(new.prompt_token_ids or [])
            request = self._requests.pop(new.req_id, None)
            self._tracked[new.req_id] = _Tracked(
                prompt=prompt, block_ids=list(new.block_ids[0]) if new.block_ids else [],
                tenant=tenant_of(request), stored=(state.hit or 0) if state is not None else 0, request=request)
            self._maybe_save(plan, new.req_id, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            tracked = self._tracked.get(rid)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if rid in _resumed(cached, i):
                    tracked.block_ids = list(new_ids[0])
                else:
                    tracked.block_ids.extend(new_ids[0])
            self._maybe_save(plan, rid, cached.num_computed_tokens[i] + scheduled.get(rid, 0))
        return plan

    def _maybe_save(self, plan: StepPlan, rid: str, computed_after_step: int) -> None:
        """Once the prompt is computed, save its full chunks; after that, each chunk the decoded tokens fill
        (a multi-round chat's next prompt holds this answer). Only what no earlier save covered is copied."""
        tracked = self._tracked[rid]
        if computed_after_step < len(tracked.prompt):
            return
        everything = getattr(tracked.request, "all_token_ids", None)  # prompt and decoded tokens
        known = len(tracked.prompt)
        if computed_after_step > known and everything is not None:
            known = len(everything)
        n = min(computed_after_step, known)
        n -= n % self.chunk_tokens
        if n <= tracked.stored:
            return
        tokens = tracked.prompt if n <= len(tracked.prompt) else list(everything or ())  # n > prompt: from it
        start = tracked.stored - tracked.stored % self.chunk_tokens
        blocks = -(-n // self.block_size)
        plan.saves.append(SaveSpec(rid, tokens[:n], tracked.block_ids[:blocks], tracked.tenant, start))
        tracked.stored = n
        self.counters["saves"] += 1
        if self.events and tracked.tenant is None:  # a router gives a salted request no cache credit anyway
            self._note_stored(tracked.request, tokens, start, n)

    def _note_stored(self, request: Any, tokens: Sequence[int], start: int, end: int) -> None:
        """Tokens ``[start, end)`` (whole blocks) are being saved: their blocks, by vLLM's own block hashes."""
        hashes = getattr(request, "block_hashes", None) or ()  # the request's own list: sliced, not copied whole
        first, last = start // self.block_size, min(end // self.block_size, len(hashes))
        if last > first:
            self._stored.append(Stored(list(hashes[first:last]), hashes[first - 1] if first else None,
                                       list(tokens[first * self.block_size:last * self.block_size])))

    def take_stored(self) -> list[Stored]:
        """What the saves planned since the last call store (for vLLM's KV events)."""
        stored, self._stored = self._stored, []
        return stored

    def request_finished(self, request: Any) -> None:
        rid = request.request_id
        self._lookups.pop(rid, None)
        self._tracked.pop(rid, None)
        self._requests.pop(rid, None)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _resumed(cached: Any, i: int) -> set[str]:
    """Request ids resumed from preemption in this step (their ``new_block_ids`` replace the table)."""
    ids = getattr(cached, "resumed_req_ids", None)
    if ids is not None:
        return set(ids)
    flags = getattr(cached, "resumed_from_preemption", None)
    return {cached.req_ids[i]} if flags and flags[i] else set()
