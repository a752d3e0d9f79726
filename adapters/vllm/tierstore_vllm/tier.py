"""``TierstoreTier``: a tierstore under vLLM's native offloading, as a secondary tier of
``TieringOffloadingSpec`` (vLLM keeps its own GPU↔CPU copies, CPU tier, hybrid-model grouping and events).

```
--kv-transfer-config '{"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_connector_extra_config":
  {"spec_name":"TieringOffloadingSpec","cpu_bytes_to_use":8589934592,
   "secondary_tiers":[{"type":"TierstoreTier","module_path":"tierstore_vllm","config":"/etc/tierstore.yaml"}]}}'
```

Every method runs on vLLM's scheduler thread and returns at once: ``lookup`` answers from the store's index
(a probe of a shared tier goes to a background thread, ``RETRY`` meanwhile); ``submit_store`` and
``submit_load`` are background jobs that ``put_many`` from views of vLLM's CPU-tier chunks and ``get_many`` into
them (no copy of ours beyond what the store's tiers make).
"""

from __future__ import annotations

import itertools
import logging
import queue
import time
from collections import OrderedDict
from collections.abc import Collection, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, ClassVar

import torch
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from tierstore.engines import open_store, rank_config
from tierstore.keys import ChunkKey

from .probes import Probes
from .tier_keys import tier_keys
from .tier_metrics import TierStats, metric_definitions
from .tier_options import TierOptions
from .versions import check_vllm

log = logging.getLogger("tierstore_vllm")

#: keys whose load failed (a corrupt or vanished object) stay misses until stored again; at most this many
FAILED_KEYS = 65536
#: with events on, seconds between looks in the store's index for announced chunks it no longer holds, and how
#: many announced chunks each look checks (the oldest checked first: a large shared tier costs a bounded step)
REMOVAL_SCAN_S = 1.0
REMOVAL_SCAN_KEYS = 4096


class TierstoreTier(SecondaryTierManager):
    """A tierstore (host, disk, S3 or shared-filesystem tiers, or a node's ``tierstore serve``) as a vLLM
    secondary tier. Options: see :class:`~tierstore_vllm.tier_options.TierOptions`."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: Any = None, **options: Any) -> None:
        check_vllm()
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.options = opts = TierOptions.parse(options)
        self.locality = Locality(opts.locality)
        rows, row_bytes = primary_kv_view.shape[0], self.block_size_bytes  # type: ignore[index]
        self._keys = tier_keys(offloading_spec, opts, row_bytes)
        self._rows = torch.frombuffer(primary_kv_view, dtype=torch.int8).view(rows, row_bytes)
        config = opts.config
        par = offloading_spec.config.parallel
        if par.data_parallel_size > 1 and not opts.through_server:  # one disk directory per engine process
            config = rank_config(config, f"dp{par.data_parallel_index}")
        self.store = open_store(config)
        self._shared = opts.through_server or any(lv.shared for lv in self.store.tiers)
        self._loads = ThreadPoolExecutor(opts.io_threads, thread_name_prefix="tierstore-tier-load")
        self._stores = ThreadPoolExecutor(opts.io_threads, thread_name_prefix="tierstore-tier-store")
        # probes have a thread of their own: queued behind loads they would wait for them, and every step they
        # wait is a step the request waits (RETRY) with its chunks on the shared tier
        self._probing = ThreadPoolExecutor(1, thread_name_prefix="tierstore-tier-probe")
        self._probes = Probes(self.store.contains_many, self._probing)
        self._jobs: dict[int, Future[None]] = {}
        self._done: queue.SimpleQueue[tuple[JobResult, list[OffloadKey], list[OffloadKey]]] = queue.SimpleQueue()
        self._failed: OrderedDict[OffloadKey, None] = OrderedDict()
        self._stats = None if opts.through_server else TierStats(self.store)  # a node server reports its own
        kv_events = offloading_spec.kv_events_config.enable_kv_cache_events
        self._events: list[OffloadingEvent] | None = [] if opts.enable_kv_events and kv_events else None
        #: chunks announced as stored and not (yet) as removed; a node server's evictions are not seen here
        self._announced: dict[OffloadKey, ChunkKey] | None = (
            {} if self._events is not None and not opts.through_server else None)
        self._next_scan = 0.0
        log.info("tierstore: secondary tier %s over %s (%s), keys %s, %d bytes per chunk", tier_type, self.store,
                 self.locality.value, self._keys.namespace, self._keys.payload_bytes)

    # ------------------------------------------------------------------ lookups
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if key in self._failed:
            return LookupResult.MISS
        verdict = self._probes.verdict(key, req_context.req_id)
        if verdict is not None:
            return LookupResult.HIT if verdict else LookupResult.MISS
        chunk = self._keys.key(key)
        if not self.options.through_server and self.store.locate([chunk], probe=False):  # the index: no I/O
            return LookupResult.HIT
        if not self._shared:
            return LookupResult.MISS
        self._probes.ask(key, chunk, req_context.req_id)  # in no index: ask the shared tier in the background, once
        return LookupResult.RETRY

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        chunks = [self._keys.key(k) for k in keys]
        if self.options.through_server:
            self._loads.submit(self._touch, chunks)
        else:
            self._touch(chunks)

    def _touch(self, chunks: list[ChunkKey]) -> None:
        self.store.release(self.store.pin(chunks))  # a pin marks the copies most recently used

    # ------------------------------------------------------------------ transfers
    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        items = [(self._keys.key(k), {"kv": self._chunk(c)}) for k, c in zip(keys, job_metadata.chunk_ids, strict=True)]
        self._jobs[job_metadata.job_id] = self._stores.submit(self._store, job_metadata.job_id, keys, items)

    def _store(self, job_id: int, keys: list[OffloadKey], items: list[tuple[ChunkKey, dict[str, torch.Tensor]]]
               ) -> None:
        start = time.perf_counter()
        held = 0
        try:
            held = len(self.store.locate([c for c, _ in items], probe=False))  # a stored prefix is not written again
            ok = self.store.put_many(items[held:])
        except Exception as exc:  # the store degrades to a skipped write; this is belt and braces
            log.warning("tierstore: storing %d chunks failed: %s", len(items), exc)
            held, ok = 0, [False] * len(items)
        stored = keys[:held] + [k for k, good in zip(keys[held:], ok, strict=True) if good]
        result = JobResult(job_id, success=len(stored) == len(keys), transfer_time=time.perf_counter() - start,
                           transfer_bytes=(len(items) - held) * self._keys.payload_bytes)
        self._done.put((result, stored, []))

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        chunks = [self._keys.key(k) for k in keys]
        outs = [{"kv": self._chunk(c)} for c in job_metadata.chunk_ids]
        self._jobs[job_metadata.job_id] = self._loads.submit(self._load, job_metadata.job_id, keys, chunks, outs)

    def _load(self, job_id: int, keys: list[OffloadKey], chunks: list[ChunkKey],
              outs: list[dict[str, torch.Tensor]]) -> None:
        start = time.perf_counter()
        try:
            got = self.store.get_many(chunks, out=outs)  # straight into vLLM's CPU-tier chunks
        except Exception as exc:  # a miss, never wrong data: vLLM recomputes
            log.warning("tierstore: loading %d chunks failed: %s", len(chunks), exc)
            got = [None] * len(chunks)
        loaded = [k for k, g in zip(keys, got, strict=True) if g is not None]
        failed = [k for k, g in zip(keys, got, strict=True) if g is None]
        result = JobResult(job_id, success=not failed, successful_keys=tuple(loaded) if failed and loaded else None,
                           transfer_time=time.perf_counter() - start,
                           transfer_bytes=len(loaded) * self._keys.payload_bytes)
        self._done.put((result, [], failed))

    def _chunk(self, chunk_id: Any) -> torch.Tensor:
        return self._rows[int(chunk_id), :self._keys.payload_bytes]

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results: list[JobResult] = []
        while True:
            try:
                result, stored, failed = self._done.get_nowait()
            except queue.Empty:
                return results
            self._jobs.pop(result.job_id, None)
            for key in stored:
                self._failed.pop(key, None)
            self._probes.settle(stored, True)
            if stored and self._events is not None:
                self._events.append(OffloadingEvent(keys=stored, medium=Medium.STORAGE, removed=False,
                                                    locality=self.locality))
                if self._announced is not None:
                    self._announced.update((k, self._keys.key(k)) for k in stored)
            if failed:  # never promised again (vLLM would retry the promotion for ever)
                log.warning("tierstore: %d of the chunks a load asked for were misses (corrupt or gone); "
                            "vLLM recomputes them", len(failed))
                self._probes.settle(failed, False)
                for key in failed:
                    self._failed[key] = None
                while len(self._failed) > FAILED_KEYS:
                    self._failed.popitem(last=False)
            results.append(result)

    def drain_jobs(self) -> None:
        wait(list(self._jobs.values()))

    def has_pending_work(self) -> bool:
        return bool(self._jobs) or self._probes.busy

    # ------------------------------------------------------------------ requests, steps
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._probes.release(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._probes.flush()

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self._events is None:
            return ()
        self._scan_removals()
        if not self._events:
            return ()
        events, self._events = self._events, []
        return events

    def _scan_removals(self) -> None:
        """Announce as removed the announced chunks the store's index no longer holds in any tier (evicted from
        the last, deleted, or dropped as damaged): every :data:`REMOVAL_SCAN_S` at most, the
        :data:`REMOVAL_SCAN_KEYS` checked longest ago, from the index (no I/O)."""
        now = time.monotonic()
        if not self._announced or now < self._next_scan:
            return
        self._next_scan = now + REMOVAL_SCAN_S
        keys = list(itertools.islice(self._announced, REMOVAL_SCAN_KEYS))
        held = self.store.residency.locate([self._announced[k] for k in keys])
        gone = []
        for key, tier in zip(keys, held, strict=True):
            chunk = self._announced.pop(key)
            if tier is None:
                gone.append(key)
            else:
                self._announced[key] = chunk  # to the back: the next look checks others first
        if gone and self._events is not None:
            self._events.append(OffloadingEvent(keys=gone, medium=Medium.STORAGE, removed=True,
                                                locality=self.locality))

    # ------------------------------------------------------------------ metrics, shutdown
    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        return metric_definitions()

    def get_stats(self) -> Any:
        return self._stats.take() if self._stats is not None else None

    def shutdown(self) -> None:
        self.drain_jobs()
        self._probing.shutdown(wait=True)
        self._loads.shutdown(wait=True)
        self._stores.shutdown(wait=True)
        self.store.close()
        self._rows = torch.empty(0, 0, dtype=torch.int8)  # let go of vLLM's CPU-tier buffer
