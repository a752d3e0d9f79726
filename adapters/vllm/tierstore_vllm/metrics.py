"""tierstore's metrics on vLLM's own ``/metrics``, through the connector stats API.

Each worker rank turns its store's ``stats()`` into deltas once per step (:class:`StatsDeltas`; with a node
server, the scheduler its lookups' token counters, and the tiers are the server's to report); vLLM ships
them to the process that serves ``/metrics`` (the API server, when the engine core runs in another process),
sums them over ranks (:class:`TierstoreStats`) and hands them to :class:`TierstorePromMetrics`, which
registers the families of :data:`tierstore.metrics.TIER_FAMILIES` with vLLM's metric classes and labels
(``model_name``, ``engine``) plus ``tier`` — and ``rank`` on gauges, which are per rank, not summed.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from tierstore.metrics import LAYER_COUNTERS, PREFIX, TIER_FAMILIES

#: per-tier families shipped through vLLM (the store-level latency histograms stay embedded-only)
_COUNTERS = {f.stat: f for f in TIER_FAMILIES if f.kind == "counter"}
_GAUGES = {f.stat: f for f in TIER_FAMILIES if f.kind == "gauge"}
_KV = ("kv_lookup_tokens", "kv_hit_tokens")
_SEP = "|"  # stats keys are "name|tier" (counters) or "name|tier|rank" (gauges): msgspec-safe strings


@dataclass
class TierstoreStats(KVConnectorStats):
    """``data``: ``{"counters": {key: delta}, "gauges": {key: value}}``; counters add up over ranks and
    steps, gauges keep the latest value (their keys carry the rank)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data: dict[str, Any] = {"counters": {}, "gauges": {}}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        counters, gauges = self.data.setdefault("counters", {}), self.data.setdefault("gauges", {})
        for key, n in other.data.get("counters", {}).items():
            counters[key] = counters.get(key, 0) + n
        gauges.update(other.data.get("gauges", {}))
        return self

    def reduce(self) -> dict[str, int | float]:
        return {**self.data.get("counters", {}), **self.data.get("gauges", {})}

    def is_empty(self) -> bool:
        return not self.data.get("counters") and not self.data.get("gauges")


class StatsDeltas:
    """What one rank's store counted since the last call (:meth:`take`), in :class:`TierstoreStats` form.

    ``tiers=False`` for a node server's client: its tiers are the node's, counted once on the server's own
    ``/metrics`` (each engine reporting them would count every hit once per engine); only this process's
    token counters (``kv_lookup_tokens``, ``kv_hit_tokens``) are taken, with no request to the server."""

    def __init__(self, store: Any, rank: str, tiers: bool = True) -> None:
        self.store = store
        self.rank = rank
        self.tiers = tiers
        self._last: dict[str, float] = {}
        self._gauges: dict[str, float] = {}
        self._lock = threading.Lock()

    def take(self) -> TierstoreStats | None:
        if self.tiers:
            st = self.store.stats()
        else:
            st = {"tiers": {t.name: {} for t in self.store.tiers}, "counters": self.store.counters.snapshot()}
        now: dict[str, float] = {}
        gauges: dict[str, float] = {}
        for tier, ts in st["tiers"].items():
            for stat, fam in _COUNTERS.items():
                if ts.get(stat) is not None:
                    now[_SEP.join((fam.name, tier))] = float(ts[stat])
            for stat, fam in _GAUGES.items():
                if ts.get(stat) is not None:
                    gauges[_SEP.join((fam.name, tier, self.rank))] = float(ts[stat])
        for name in _KV:
            labels = {**dict.fromkeys(st["tiers"] if name == "kv_hit_tokens" else [""], 0),
                      **st["counters"].get(name, {})}
            for label, n in labels.items():
                now[_SEP.join((name, label))] = float(n)
        with self._lock:
            first = not self._last  # the first report names every series (at 0 if so): see tierstore.metrics
            deltas = {k: v - self._last.get(k, 0.0) for k, v in now.items() if first or v != self._last.get(k, 0.0)}
            changed = {k: v for k, v in gauges.items() if self._gauges.get(k) != v}
            self._last, self._gauges = now, gauges
        if not deltas and not changed:
            return None
        return TierstoreStats(data={"counters": deltas, "gauges": changed})


class TierstorePromMetrics(KVConnectorPromMetrics):
    """Registers tierstore's families with vLLM's metric classes and records each step's stats."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._metrics: dict[str, Any] = {}
        for fam in TIER_FAMILIES:
            if fam.kind == "counter":
                self._metrics[fam.name] = self._counter_cls(name=PREFIX + fam.name, documentation=fam.help,
                                                            labelnames=[*labelnames, "tier"])
            else:
                self._metrics[fam.name] = self._gauge_cls(name=PREFIX + fam.name, documentation=fam.help,
                                                          labelnames=[*labelnames, "tier", "rank"],
                                                          multiprocess_mode="mostrecent")
        for name in _KV:
            help_text, label = LAYER_COUNTERS[name]
            self._metrics[name] = self._counter_cls(name=PREFIX + name, documentation=help_text,
                                                    labelnames=[*labelnames, *([label] if label else [])])

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = [str(v) for v in self.per_engine_labelvalues[engine_idx]]
        for key, n in transfer_stats_data.get("counters", {}).items():
            name, *rest = key.split(_SEP)
            metric = self._metrics.get(name)
            if metric is not None and n >= 0:
                metric.labels(*labels, *[r for r in rest if r]).inc(n)
        for key, value in transfer_stats_data.get("gauges", {}).items():
            name, *rest = key.split(_SEP)
            metric = self._metrics.get(name)
            if metric is not None:
                metric.labels(*labels, *rest).set(value)
