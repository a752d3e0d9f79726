"""Prometheus metrics of a store, read from ``stats()`` and the latency histograms at scrape time.

Every value comes from the same counters ``stats()`` returns, so the two never disagree. Names start
with ``tierstore_``; per-tier families carry a ``tier`` label. :data:`TIER_FAMILIES` is the one table of
per-tier families; the vLLM connector builds its metrics (on vLLM's own ``/metrics``) from it too.

* embedded: config ``metrics: {port: 9400, host: 127.0.0.1}`` serves ``/metrics`` (:class:`MetricsServer`) on
  loopback unless ``host`` names another address, with at most :data:`WORKERS` requests at once, each given
  :data:`REQUEST_TIMEOUT` s (connections past that are closed at once: idle ones cost no thread);
* ``tierstore stats --prometheus [FILE]``: the text format, for a node exporter's textfile collector.
"""

from __future__ import annotations

import logging
import os
import socket
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from http.server import HTTPServer
from socketserver import ThreadingMixIn
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import MetricsHandler
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from .errors import ConfigError
from .telemetry import Latency

log = logging.getLogger("tierstore")

PREFIX = "tierstore_"
#: requests the embedded endpoint serves at once, and seconds each may take (a slow or idle client included)
WORKERS, REQUEST_TIMEOUT = 4, 5.0


@dataclass(frozen=True)
class Family:
    """One per-tier family: its name (after ``tierstore_``, before ``_total``), type, help and the key of a
    tier's ``stats()`` it reads."""

    name: str
    kind: str  # "counter" | "gauge"
    help: str
    stat: str


TIER_FAMILIES = (
    Family("hits", "counter", "Chunks read from the tier (hits)", "hits"),
    Family("misses", "counter", "Chunks asked of the tier that it did not hold", "misses"),
    Family("read_bytes", "counter", "Bytes of chunks read from the tier", "bytes_out"),
    Family("written_bytes", "counter", "Bytes of chunks written to the tier", "bytes_in"),
    Family("puts", "counter", "Chunks written to the tier", "puts"),
    Family("skipped_puts", "counter", "Puts the tier refused (too big, no room in time, read-only)", "skipped"),
    Family("evictions", "counter", "Chunks evicted to make room", "evictions"),
    Family("corrupt_objects", "counter", "Objects that failed their checksum or header checks (read as misses)",
           "corrupt"),
    Family("unsupported_objects", "counter", "Objects of a newer format or unknown dtype (left in place)",
           "unsupported"),
    Family("forged_objects", "counter", "Objects on a tier with keys that failed authentication (unsealed, "
           "unknown key id, wrong seal; read as misses, left in place)", "forged"),
    Family("errors", "counter", "I/O errors (reads and writes treated as misses or skips)", "errors"),
    Family("enospc", "counter", "Writes that found the device full", "enospc"),
    Family("writeback_done", "counter", "Chunks written back into this tier", "writeback_done"),
    Family("writeback_failures", "counter", "Failed write-back attempts into this tier (retried while held)",
           "writeback_failed"),
    Family("writeback_dropped", "counter", "Dirty chunks dropped by the on_pressure=drop policy before reaching "
           "this tier", "writeback_dropped"),
    Family("touches", "counter", "Objects whose last use this process refreshed (remote tiers, for gc)", "touches"),
    Family("objects", "gauge", "Chunks the tier holds", "objects"),
    Family("used_bytes", "gauge", "Bytes the tier holds", "used_bytes"),
    Family("capacity_bytes", "gauge", "The tier's capacity (absent when unbounded)", "capacity_bytes"),
    Family("reserved_bytes", "gauge", "Bytes set aside by puts in progress", "reserved_bytes"),
    Family("pinned_objects", "gauge", "Chunks pinned by readers", "pinned"),
    Family("writeback_pending", "gauge", "Chunks waiting to be written back into this tier", "writeback_pending"),
    Family("writeback_lag_seconds", "gauge", "Age of the oldest chunk waiting to be written into this tier",
           "writeback_lag_s"),
    Family("remote_backoff_seconds", "gauge", "Seconds a remote tier fails fast after its last failure "
           "(0 while it answers)", "backoff_s"),
)

#: store-level counters of ``stats()`` (name after ``tierstore_``, help, key)
STORE_COUNTERS = (
    ("get_keys", "Keys asked of the store by get/get_many", "gets"),
    ("get_hits", "Keys the store returned", "hits"),
    ("get_misses", "Keys the store did not hold", "misses"),
    ("put_keys", "Chunks put into the store", "puts"),
    ("promotions", "Chunks admitted to a faster tier after a read or a prefetch", "promotions"),
    ("prefetch_errors", "Prefetches that raised", "prefetch_errors"),
)

#: ``store.counters`` the layers above fill in: name -> (help, label name)
LAYER_COUNTERS = {
    "kv_lookup_tokens": ("Prompt tokens asked about by KV lookups", ""),
    "kv_hit_tokens": ("Prompt tokens KV lookups found, by the tier holding them (÷ kv_lookup_tokens = "
                      "token hit rate)", "tier"),
    "weights_bytes": ("Checkpoint bytes read by weight loads, by where they came from (cache or source)",
                      "source"),
    "weights_ranges": ("Checkpoint byte ranges read by weight loads, by where they came from", "source"),
}


def families(stats: Mapping[str, Any], store_latency: Latency | None = None,
             tier_latency: Mapping[str, Latency] | None = None) -> Iterator[Metric]:
    """The metric families of one ``stats()`` result (a store's, or ``{"tiers": ...}`` alone) and its
    latency histograms."""
    tiers: Mapping[str, Mapping[str, Any]] = stats.get("tiers", {})
    for fam in TIER_FAMILIES:
        cls = CounterMetricFamily if fam.kind == "counter" else GaugeMetricFamily
        metric = cls(PREFIX + fam.name, fam.help, labels=["tier"])
        for name, st in tiers.items():
            value = st.get(fam.stat)
            if value is not None:
                metric.add_metric([name], float(value))
        if metric.samples:
            yield metric
    failures = CounterMetricFamily(PREFIX + "failures", "Failures by tier and reason (each is logged, rate-limited)",
                                   labels=["tier", "reason"])
    for name, st in tiers.items():
        for reason, n in sorted(st.get("failures", {}).items()):
            failures.add_metric([name, reason], float(n))
    yield failures
    for name, help_text, key in STORE_COUNTERS:
        if key in stats:
            yield CounterMetricFamily(PREFIX + name, help_text, value=float(stats[key]))
    if "pending_writeback" in stats:
        yield GaugeMetricFamily(PREFIX + "dirty_chunks", "Chunks not yet written to every tier below",
                                value=float(stats["pending_writeback"]))
    counters: Mapping[str, Mapping[str, float]] = stats.get("counters", {})
    for name, (help_text, label) in LAYER_COUNTERS.items():
        # every series exists from the start (at 0): rate() over a series born at its first hit would miss it
        zero: dict[str, float] = dict.fromkeys(tiers, 0) if label == "tier" else {} if label else {"": 0}
        per = {**zero, **counters.get(name, {})}
        metric = CounterMetricFamily(PREFIX + name, help_text, labels=[label] if label else [])
        for value, n in sorted(per.items()):
            metric.add_metric([value] if label else [], float(n))
        yield metric
    if store_latency is not None:
        yield _histogram(PREFIX + "op_seconds", "Latency of the store's get/put/lookup calls, as callers see them",
                         ["op"], {(op,): h for op, h in store_latency.snapshot().items()}, store_latency.bounds)
    if tier_latency:
        per_tier: dict[tuple[str, ...], tuple[list[int], float]] = {
            (tier, op): h for tier, lat in tier_latency.items() for op, h in lat.snapshot().items()}
        bounds = next(iter(tier_latency.values())).bounds
        yield _histogram(PREFIX + "tier_op_seconds", "Latency of each tier's batched get/put/lookup calls",
                         ["tier", "op"], per_tier, bounds)


#: the figures of one ``tierstore gc`` pass per remote tier: (key of the pass's result, name, help)
GC_GAUGES = (
    ("objects", "gc_objects", "Chunk objects the last gc pass listed under the prefix"),
    ("bytes", "gc_bytes", "Bytes of those objects"),
    ("bytes_after", "gc_bytes_after", "Bytes left under the prefix after the last gc pass"),
    ("removed_objects", "gc_removed_objects", "Objects the last gc pass removed"),
    ("stale_temp_removed", "gc_removed_temp_files", "Stale temp files the last gc pass removed"),
    ("protected_by_grace", "gc_protected_objects", "Objects kept over budget because the grace period protects them"),
    ("seconds", "gc_pass_seconds", "How long the last gc pass took"),
    ("finished", "gc_last_pass_timestamp_seconds", "When the last gc pass ended (Unix time)"),
    ("failed_passes", "gc_failed_passes", "Passes of this gc --watch that failed (storage unreachable) since it began"),
)


class GcCollector(Collector):
    """The last ``tierstore gc`` pass (``{tier: result}``) as gauges with a ``tier`` label."""

    def __init__(self, result: Mapping[str, Mapping[str, float]]) -> None:
        self._result = result

    def collect(self) -> Iterator[Metric]:
        for key, name, help_text in GC_GAUGES:
            metric = GaugeMetricFamily(PREFIX + name, help_text, labels=["tier"])
            for tier, r in self._result.items():
                if key in r:
                    metric.add_metric([tier], float(r[key]))
            yield metric


def _histogram(name: str, help_text: str, labels: list[str], series: Mapping[tuple[str, ...], tuple[list[int], float]],
               bounds: tuple[float, ...]) -> HistogramMetricFamily:
    metric = HistogramMetricFamily(name, help_text, labels=labels)
    edges = [floatToGoString(b) for b in bounds] + ["+Inf"]  # type: ignore[no-untyped-call]
    for values, (cumulative, total) in sorted(series.items()):
        metric.add_metric(list(values), list(zip(edges, [float(c) for c in cumulative], strict=True)), total)
    return metric


class StoreCollector(Collector):
    """Collects one store (anything with ``stats()``, ``latency`` and ``tiers``) at scrape time."""

    def __init__(self, source: Callable[[], Mapping[str, Any]], store_latency: Latency | None = None,
                 tier_latency: Mapping[str, Latency] | None = None) -> None:
        self._source = source
        self._store_latency = store_latency
        self._tier_latency = tier_latency

    @classmethod
    def of(cls, store: Any) -> StoreCollector:
        return cls(store.stats, store.latency, {t.name: t.latency for t in store.tiers})

    def collect(self) -> Iterator[Metric]:
        yield from families(self._source(), self._store_latency, self._tier_latency)


def exposition(collector: Collector) -> bytes:
    """The Prometheus text format of ``collector``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return generate_latest(registry)


def write_textfile(path: str, collector: Collector) -> None:
    """Write the text format to ``path`` atomically (what a node exporter's textfile collector reads)."""
    text = exposition(collector)
    fd, tmp = tempfile.mkstemp(prefix=".tierstore-", suffix=".prom.tmp", dir=os.path.dirname(os.path.abspath(path)))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


class MetricsServer:
    """``/metrics`` of one store over HTTP (config ``metrics: {port, host}``); stopped by the store's close."""

    def __init__(self, store: Any, port: int, host: str = "127.0.0.1") -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(StoreCollector.of(store))
        handler = type("Handler", (MetricsHandler.factory(self.registry),), {"timeout": REQUEST_TIMEOUT})
        try:
            self._server = _BoundedServer((host, port), handler)
        except OSError as exc:
            raise ConfigError(f"metrics: cannot serve on {host}:{port}: {exc}") from None
        self._thread = threading.Thread(target=self._server.serve_forever, name="tierstore-metrics", daemon=True)
        self._thread.start()
        self.host, self.port = host, self._server.server_port
        log.info("tierstore: metrics on http://%s:%d/metrics", host, self.port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5.0)


class _BoundedServer(ThreadingMixIn, HTTPServer):
    """An HTTP server with at most :data:`WORKERS` request threads; a connection past them is closed at once."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: Any) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self._slots = threading.BoundedSemaphore(WORKERS)
        self.refused = 0
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()
