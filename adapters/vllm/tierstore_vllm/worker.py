"""The connector's worker half: one per tensor/pipeline-parallel rank, owning that rank's store.

It answers the scheduler's lookups (:mod:`.lookup`), loads planned prefixes into vLLM's paged KV cache
layer by layer, and saves finished prompts: straight into the store's host pool where it has one (see
:meth:`WorkerSide.wait_for_save`), else through copies written in the background.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

import tierstore
from tierstore.kv import KVCacheStore, KVNamespace, LayerwiseLoad, PagedLayout, gather

from .plan import LoadSpec, SaveSpec, StepPlan

log = logging.getLogger("tierstore_vllm")

#: default bytes of KV copied out of the paged cache and not yet written to the store (``save_memory``); a save
#: that would go over is dropped (counted): a slow tier never holds more of the engine's memory. Only a store that
#: cannot save in place holds such copies; they live on the paged cache's device (GPU memory outside vLLM's KV
#: budget with a CUDA cache; host memory on CPU). A store saving in place holds none: the bytes go straight into
#: its host pool (bounded by that tier's capacity)
SAVE_MEMORY = 1 << 30
#: tenants (``cache_salt`` values) whose KV cache objects a worker keeps; more are rebuilt on use
TENANTS_KEPT = 64


# --------------------------------------------------------------------------- data path
def start_prefix_load(kv: KVCacheStore, spec: LoadSpec, caches: list[torch.Tensor], layout: PagedLayout,
                      block_size: int) -> LayerwiseLoad:
    """Start writing tokens ``[spec.start, n)`` of ``spec.token_ids`` into the request's blocks of
    ``caches`` (one per layer, in model order), where ``n`` is the leading part still stored; one
    future per layer. A chunk that vanished since the lookup shortens ``n``."""
    handle = kv.load_into(spec.token_ids, caches, layout, spec.block_ids, start=spec.start,
                          block_size=block_size, layerwise=True)
    assert isinstance(handle, LayerwiseLoad)
    return handle


def save_prefix(kv: KVCacheStore, spec: SaveSpec, layers: list[torch.Tensor]) -> int:
    """Store ``layers`` (canonical, one per layer) as the KV of ``spec.token_ids``; returns tokens written."""
    written: int = kv.save(spec.token_ids, layers, start=spec.start)
    return written


def _layer_index(name: str, position: int) -> int:
    numbers = re.findall(r"\d+", name)
    return int(numbers[0]) if numbers else position


class WorkerSide:
    """Answers the worker-side connector calls for one rank.

    ``store`` is this rank's :class:`tierstore.TieredStore`; ``namespace`` names its KV (tenant unset:
    each request's tenant is filled in per call); ``block_size``/``num_kv_heads``/``head_size`` describe
    vLLM's paged cache; with ``layerwise=False`` :meth:`start_load` returns once every load is complete.

    Saves: where the store saves in place (:attr:`~tierstore.KVCacheStore.saves_in_place`: a host pool on top,
    ``write_back``), :meth:`wait_for_save` gathers each save's new chunks out of the paged cache straight into
    pool memory reserved for them and commits them (one copy, nothing pending outside the store when it
    returns). Otherwise :meth:`save_layer` copies each layer out and a background thread puts the copies, at
    most ``save_memory`` bytes of them queued.
    """

    def __init__(self, store: tierstore.TieredStore, namespace: KVNamespace, *, chunk_tokens: int,
                 block_size: int, num_kv_heads: int, head_size: int, save_memory: int = SAVE_MEMORY,
                 layerwise: bool = True):
        self.store = store
        self.layerwise = layerwise
        self.save_memory = save_memory
        self.namespace = namespace.replace(chunk_tokens=chunk_tokens)
        self.chunk_tokens = chunk_tokens
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self._base_kv = KVCacheStore(store, self.namespace)
        self._kvs: OrderedDict[str | None, KVCacheStore] = OrderedDict()
        self._kvs_lock = threading.Lock()
        self._shared = any(t.shared for t in store.tiers)  # a tier to promote from (what locate(local=) skips)
        self._promoting: dict[tierstore.ChunkKey, concurrent.futures.Future[int]] = {}
        self._promoting_lock = threading.Lock()
        self._views: dict[str, tuple[torch.Tensor, PagedLayout]] = {}
        self._index: dict[str, int] = {}
        self._plan = StepPlan()
        self._loads: list[tuple[LoadSpec, LayerwiseLoad | None]] = []
        self._gathered: dict[str, list[torch.Tensor]] = {}
        self._in_place = self._base_kv.saves_in_place
        self._saver = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tierstore-vllm-save")
        self._pending_bytes = 0  # of the copies queued saves hold (bounded by save_memory)
        self._state = threading.Lock()
        self._failed_blocks: set[int] = set()
        self.counters = dict.fromkeys(("lookups", "loaded_tokens", "load_failed_tokens", "saved_tokens",
                                       "saves_dropped", "save_errors", "promotions"), 0)

    def kv(self, tenant: str | None) -> KVCacheStore:
        """The KV cache of ``tenant`` (vLLM's ``cache_salt``): the last :data:`TENANTS_KEPT` used are kept,
        all sharing one set of staging buffers; one dropped is rebuilt on its next request (its keys are
        the same: nothing stored is lost)."""
        with self._kvs_lock:
            kv = self._kvs.get(tenant)
            if kv is None:
                kv = self._kvs[tenant] = self._base_kv.for_tenant(tenant)
                while len(self._kvs) > TENANTS_KEPT:
                    self._kvs.popitem(last=False)
            self._kvs.move_to_end(tenant)
            return kv

    def _count(self, name: str, n: int = 1) -> None:
        with self._state:
            self.counters[name] += n

    # ------------------------------------------------------------------ caches
    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Remember each layer's cache as a paged view, in model layer order."""
        from .layouts import paged_view

        names = sorted(kv_caches, key=lambda n: (_layer_index(n, 0), n))
        for i, name in enumerate(names):
            self._views[name] = paged_view(kv_caches[name], self.block_size, self.num_kv_heads, self.head_size)
            self._index[name] = i

    # ------------------------------------------------------------------ lookups (lookup-server thread)
    def answer(self, request: dict[str, Any]) -> dict[str, Any]:
        """``{"ready": leading tokens of request["tokens"] held in a local tier, "pending": True while
        chunks right after them are being promoted from a remote tier}``.

        ``request["asked"]`` prompt tokens (0 on a repeated ask) are counted in the store's token hit rate,
        the hits under the tier each chunk was found in (a remote run being promoted counts as remote)."""
        self._count("lookups")
        kv = self.kv(request.get("tenant"))
        keys = kv.keys(request["tokens"])
        held = self.store.locate(keys, local=True)
        pending = False
        promoted: list[str] = []
        if len(held) < len(keys) and self._shared:
            pending, promoted = self._promote(keys[len(held):])
        asked = int(request.get("asked", 0))
        if asked:
            found = held + promoted
            kv.count_tokens(asked, found, len(found) * self.chunk_tokens)
        return {"ready": len(held) * self.chunk_tokens, "pending": pending}

    def _promote(self, keys: list[tierstore.ChunkKey]) -> tuple[bool, list[str]]:
        """Start promoting the remote run ``keys`` to the local tiers: whether that is in progress, and the
        tiers holding the run when this call found it."""
        with self._promoting_lock:
            for k in [k for k, f in self._promoting.items() if f.done()]:
                del self._promoting[k]
            if keys[0] in self._promoting:
                return True, []
        run = self.store.locate(keys)  # probes the shared tier until the first miss
        if not run:
            return False, []
        future = self.store.prefetch(keys[:len(run)])
        self._count("promotions", len(run))
        with self._promoting_lock:
            for k in keys[:len(run)]:
                self._promoting[k] = future
        return True, run

    # ------------------------------------------------------------------ per step
    def bind(self, plan: StepPlan) -> None:
        self._plan = plan

    def start_load(self) -> None:
        """Start loading this step's planned prefixes (one layer-wise load per request); layer ``i``
        is usable once :meth:`wait_for_layer` returns for it (without :attr:`layerwise`: on return)."""
        self._finish_loads()  # a previous step's loads, if vLLM never asked for their outcome
        if not self._plan.loads:
            return
        names = sorted(self._index, key=self._index.__getitem__)
        caches = [self._views[n][0] for n in names]
        layout = self._views[names[0]][1]  # one attention backend: every layer has the same layout
        loads: list[tuple[LoadSpec, LayerwiseLoad | None]] = []
        for spec in self._plan.loads:
            handle = None
            try:
                handle = start_prefix_load(self.kv(spec.tenant), spec, caches, layout, self.block_size)
            except Exception as exc:  # a broken tier is a miss, never a crash
                log.warning("tierstore: load of %s failed: %r", spec.req_id, exc)
            loads.append((spec, handle))
        with self._state:
            self._loads = loads
        if not self.layerwise:
            for _, handle in loads:
                if handle is not None:
                    with contextlib.suppress(Exception):  # accounted for in _finish_loads
                        handle.result()

    def _fail(self, spec: LoadSpec, good: int) -> None:
        """Report the blocks holding tokens ``[good, spec.end)`` as not loaded (vLLM recomputes them)."""
        first = good // self.block_size
        last = -(-spec.end // self.block_size)
        with self._state:
            self._failed_blocks.update(spec.block_ids[first:last])
            self.counters["load_failed_tokens"] += spec.end - good

    def wait_for_layer(self, layer_name: str) -> None:
        """Block until every load of this step has written layer ``layer_name`` (a failed load is
        accounted for in :meth:`_finish_loads`)."""
        i = self._index[layer_name]
        for _, handle in self._loads:
            if handle is not None:
                with contextlib.suppress(Exception):
                    handle.wait_for_layer(i)

    def _finish_loads(self) -> None:
        """Wait for this step's loads; the blocks past what each really loaded are reported failed."""
        with self._state:
            loads, self._loads = self._loads, []
        for spec, handle in loads:
            got = spec.start
            if handle is not None:
                try:
                    got = max(spec.start, min(handle.result(), spec.end))
                except Exception as exc:
                    log.warning("tierstore: load of %s failed: %r", spec.req_id, exc)
            if got < spec.end:
                self._fail(spec, got)
            self._count("loaded_tokens", got - spec.start)

    def save_layer(self, layer_name: str) -> None:
        """Copy this layer's KV of this step's saves (from each one's ``start``) out of the paged cache (saving in
        place, nothing: :meth:`wait_for_save` copies every layer at once)."""
        if not self._plan.saves or self._in_place:
            return
        cache, layout = self._views[layer_name]
        for spec in self._plan.saves:
            self._gathered.setdefault(spec.req_id, []).append(
                gather(cache, layout, spec.block_ids, spec.start, len(spec.token_ids)))

    def wait_for_save(self) -> None:
        """On return the step's saves no longer need the blocks, so vLLM may reuse them: saved in place (the
        store's top tier holds them; lower tiers are written in the background), or copied out (in
        :meth:`save_layer`) with the writes to the store queued."""
        self._finish_loads()
        if self._in_place:
            self._save_in_place()
            return
        gathered, self._gathered = self._gathered, {}
        for spec in self._plan.saves:
            layers = gathered.get(spec.req_id)
            if not layers or len(layers) != len(self._views):
                continue
            size = sum(t.numel() * t.element_size() for t in layers)
            with self._state:  # a save larger than the budget still goes when none is queued
                if self._pending_bytes and self._pending_bytes + size > self.save_memory:
                    self.counters["saves_dropped"] += 1
                    continue
                self._pending_bytes += size
            self._saver.submit(self._save, spec, layers, size)

    def _save_in_place(self) -> None:
        """Each save's chunks from its ``start`` gathered straight into the store's pool and committed (no I/O
        before the copy: held chunks are those the in-memory indexes know). This is the forward thread: room
        comes only from free pool memory and clean copies (``wait=False``); chunks without room are not saved."""
        names = sorted(self._index, key=self._index.__getitem__)
        if not names:
            return
        caches = [self._views[n][0] for n in names]
        layout = self._views[names[0]][1]
        for spec in self._plan.saves:
            try:
                self._count("saved_tokens", self.kv(spec.tenant).save_from(
                    spec.token_ids, caches, layout, spec.block_ids, block_size=self.block_size, start=spec.start,
                    probe=False, wait=False))
            except Exception as exc:  # a failed save is a future miss, never an engine error
                self._count("save_errors")
                log.warning("tierstore: save of %s failed: %r", spec.req_id, exc)

    def _save(self, spec: SaveSpec, layers: list[torch.Tensor], size: int) -> None:
        try:
            self._count("saved_tokens", save_prefix(self.kv(spec.tenant), spec, layers))
        except Exception as exc:  # a failed save is a future miss, never an engine error
            self._count("save_errors")
            log.warning("tierstore: save of %s failed: %r", spec.req_id, exc)
        finally:
            with self._state:
                self._pending_bytes -= size

    def take_failed_blocks(self) -> set[int]:
        self._finish_loads()
        with self._state:
            failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def drain(self, timeout: float | None = None) -> None:
        """Wait until queued saves have reached the store's top tier (tests, shutdown)."""
        self._saver.submit(lambda: None).result(timeout=timeout)

    def close(self) -> None:
        self._finish_loads()
        self._saver.shutdown(wait=True)
        self.store.close()
