"""``TierstoreConnector``: vLLM's KV connector API on top of :mod:`.scheduler` and :mod:`.worker`.

Enable it with ``--kv-transfer-config '{"kv_connector":"TierstoreConnector","kv_connector_module_path":
"tierstore_vllm","kv_role":"kv_both","kv_connector_extra_config":{"config": <dict or path>}}'``.
"""

from __future__ import annotations

import atexit
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tierstore.engines import open_store
from tierstore.errors import ConfigError
from tierstore.kv import KVNamespace

from .lookup import LookupClient, LookupServer
from .metrics import StatsDeltas, TierstorePromMetrics, TierstoreStats
from .options import ConnectorOptions, rank_config, socket_path
from .plan import StepPlan
from .scheduler import SchedulerSide
from .worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("tierstore_vllm")


class TierstoreMetadata(KVConnectorMetadata):
    """One step's :class:`~tierstore_vllm.plan.StepPlan`, shipped from the scheduler to the workers."""

    def __init__(self, plan: StepPlan):
        self.plan = plan


def _model_name(vllm_config: VllmConfig, options: ConnectorOptions) -> tuple[str, str]:
    mc = vllm_config.model_config
    name = options.model_id or mc.served_model_name or mc.model
    if isinstance(name, list):
        name = name[0]
    revision = options.revision if options.revision is not None else (mc.revision or "")
    return str(name), str(revision)


class TierstoreConnector(KVConnectorBase_V1, SupportsHMA):
    """Shares vLLM's prompt KV through a tierstore (host, disk, S3/shared-fs tiers).

    In the scheduler process it answers how many prompt tokens can be loaded by asking every worker
    rank over a local socket; each worker rank owns its own store (see ``adapters/vllm/README.md``). With a
    node server in the config (``{"server": "unix:///..."}``) every rank loads and saves through it and the
    scheduler asks it directly (no lookup sockets).
    Supports one full-attention KV cache group (``--disable-hybrid-kv-cache-manager`` is not needed).
    """

    _cache_hit_source = CacheHitSource.DISK

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self._options = options = ConnectorOptions.parse(extra)
        groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
        if len(groups) != 1 or not hasattr(groups[0].kv_cache_spec, "num_kv_heads"):
            raise ConfigError(f"TierstoreConnector supports one attention KV cache group, got {len(groups)}")
        spec = groups[0].kv_cache_spec
        self._block_size = spec.block_size
        self._chunk_tokens = options.chunk_size(spec.block_size)
        parallel = vllm_config.parallel_config
        tp_size, pp_size = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        engine_id = str(self._kv_transfer_config.engine_id)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._server: LookupServer | None = None
        self._client: LookupClient | None = None
        self._deltas: StatsDeltas | None = None
        self._server_ranks: list[WorkerSide] = []
        if role == KVConnectorRole.SCHEDULER:
            if options.load_failure_policy == "recompute":
                # read by vLLM's scheduler right after it builds this connector
                self._kv_transfer_config.kv_load_failure_policy = "recompute"
            if options.through_server:  # a node's `tierstore serve`: ask it directly, no per-rank sockets
                ask = self._ask_server(vllm_config, options, spec, tp_size, pp_size)
                self._deltas = StatsDeltas(self._server_ranks[0].store, rank="scheduler", tiers=False)
            else:
                paths = [socket_path(options.socket_dir, engine_id, tp, pp)
                         for pp in range(pp_size) for tp in range(tp_size)]
                self._client = LookupClient(paths)
                ask = self._client.ask
            events = vllm_config.kv_events_config
            self._scheduler = SchedulerSide(ask, chunk_tokens=self._chunk_tokens,
                                            block_size=self._block_size,
                                            lookup_timeout_s=options.lookup_timeout_s,
                                            remote_wait_s=options.remote_wait_s,
                                            events=bool(events is not None and events.enable_kv_cache_events))
            return
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        tp_rank, pp_rank = get_tensor_model_parallel_rank(), get_pp_group().rank_in_group
        model, revision = _model_name(vllm_config, options)
        namespace = KVNamespace(model=model, revision=revision, dtype=spec.dtype, layout="mha",
                                tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size)
        store = open_store(rank_config(options.config, tp_rank, tp_size, pp_rank, pp_size))
        self._worker = WorkerSide(store, namespace, chunk_tokens=self._chunk_tokens, block_size=spec.block_size,
                                  num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
                                  save_memory=options.save_memory, layerwise=options.layerwise)
        if not options.through_server:
            self._server = LookupServer(socket_path(options.socket_dir, engine_id, tp_rank, pp_rank),
                                        self._worker.answer)
        self._deltas = StatsDeltas(store, rank=f"tp{tp_rank}pp{pp_rank}", tiers=not options.through_server)
        atexit.register(self.shutdown)  # flush write-back even when vLLM exits without shutting us down
        log.info("tierstore: worker tp%d/%d pp%d/%d serving %s, chunk %d tokens", tp_rank, tp_size, pp_rank,
                 pp_size, store, self._chunk_tokens)

    def _ask_server(self, vllm_config: VllmConfig, options: ConnectorOptions, spec: Any, tp_size: int,
                    pp_size: int) -> Any:
        """Lookups answered from the node server: one answerer per rank over the scheduler's own client, each
        naming that rank's KV (what the rank's worker would have answered over its socket)."""
        store = open_store(options.config)
        model, revision = _model_name(vllm_config, options)
        ranks = [WorkerSide(store, KVNamespace(model=model, revision=revision, dtype=spec.dtype, layout="mha",
                                               tp_rank=tp, tp_size=tp_size, pp_rank=pp, pp_size=pp_size),
                            chunk_tokens=self._chunk_tokens, block_size=spec.block_size,
                            num_kv_heads=spec.num_kv_heads, head_size=spec.head_size)
                 for pp in range(pp_size) for tp in range(tp_size)]
        self._server_ranks = ranks
        return lambda request: [rank.answer(request) for rank in ranks]

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a later miss

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True  # wait_for_layer_load / save_kv_layer do real work between layers

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, TierstoreMetadata)
        self._worker.bind(metadata.plan)
        self._worker.start_load()

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:
            self._worker.wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        if self._worker is None:
            return
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, TierstoreMetadata)
        self._worker.bind(metadata.plan)
        self._worker.save_layer(layer_name)

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.wait_for_save()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_failed_blocks() if self._worker is not None else set()

    # ------------------------------------------------------------------ metrics (vLLM's /metrics)
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This rank's store counters since the last step (worker side), or, with a node server, the lookups'
        token counters (scheduler side, where the lookups run)."""
        return self._deltas.take() if self._deltas is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return TierstoreStats(data=data if data is not None else {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        return TierstorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._worker is not None:
            log.info("tierstore: worker counters %s", self._worker.counters)
            self._worker.close()
            self._worker = None
        if self._client is not None:
            self._client.close()
            self._client = None
        for rank in self._server_ranks:
            rank.close()
        self._server_ranks = []
        if self._scheduler is not None:
            log.info("tierstore: scheduler counters %s, %.3f s in lookups", self._scheduler.counters,
                     self._scheduler.lookup_seconds)
            self._scheduler.close()
            self._scheduler = None

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return TierstoreMetadata(self._scheduler.build_plan(scheduler_output))

    def take_events(self) -> Iterable[KVCacheEvent]:
        """KV events (with ``--kv-events-config``) for the blocks each save puts in the store, medium ``CPU``:
        a router (``vllm-router --policy kv_aware``) credits this instance with them after vLLM evicts them
        from its own cache. Sent when the save is planned (the worker copies them in that step)."""
        if self._scheduler is None:
            return ()
        stored = self._scheduler.take_stored()
        if not stored:
            return ()
        from vllm.distributed.kv_events import MEDIUM_CPU, BlockStored
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        return [BlockStored(block_hashes=[maybe_convert_block_hash(h) for h in s.block_hashes],
                            parent_block_hash=None if s.parent is None else maybe_convert_block_hash(s.parent),
                            token_ids=s.token_ids, block_size=self._block_size, lora_id=None, medium=MEDIUM_CPU,
                            lora_name=None) for s in stored]

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self._scheduler is not None:
            self._scheduler.request_finished(request)
        return False, None  # saves copy the blocks during the step, so they may be freed now

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids[0] if block_ids else [])
