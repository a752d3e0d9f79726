"""The store's per-tier counters on vLLM's ``/metrics`` through the secondary-tier stats hooks of vLLM's
tiering spec (``build_metric_definitions`` / ``get_stats``): the same ``tierstore_*`` families, labelled
``tier``, as the connector reports (:data:`tierstore.metrics.TIER_FAMILIES`)."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingGaugeMetadata, OffloadingMetricMetadata

from tierstore.metrics import PREFIX, TIER_FAMILIES

from .metrics import _SEP, StatsDeltas


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    return {PREFIX + f.name: (OffloadingCounterMetadata if f.kind == "counter" else OffloadingGaugeMetadata)(
        documentation=f.help, labelnames=("tier",)) for f in TIER_FAMILIES}


class TierStats:
    """Turns the store's counters into :class:`OffloadingConnectorStats`: what changed since the last call
    (``None`` when nothing did)."""

    def __init__(self, store: Any) -> None:
        self._deltas = StatsDeltas(store, rank="")

    def take(self) -> OffloadingConnectorStats | None:
        taken = self._deltas.take()
        if taken is None:
            return None
        names = {f.name for f in TIER_FAMILIES}
        stats = OffloadingConnectorStats()
        for key, value in taken.data["counters"].items():
            name, tier = key.split(_SEP)[:2]
            if name in names and value > 0:
                stats.increase_counter(PREFIX + name, value, (tier,))
        for key, value in taken.data["gauges"].items():
            name, tier = key.split(_SEP)[:2]
            if name in names:
                stats.set_gauge(PREFIX + name, value, (tier,))
        return None if stats.is_empty() else stats
