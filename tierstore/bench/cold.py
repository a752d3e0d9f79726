"""A cold instance against a prefix only S3 holds, behind the S3 shim (issue 9's cold-instance targets).

Another engine published ``count`` chunks. A fresh store (empty host tier; the remote tier not listed at
open, as for a prefix too large to list) looks the prefix up and loads it. Each repeat times, in turn:

* the shim's ceilings at the same concurrency, through one plain s3fs client: ``count`` HEADs (the least a
  lookup of keys no index holds can cost) and ``count`` single GETs (the least their load can cost),
  ``in_flight`` at a time;
* ``lookup`` on a fresh store whose client is started and connections open (a serving engine's state);
* the first ``lookup`` straight after ``open`` (client start-up included: botocore loads its models);
* ``get_many`` of the keys no index holds, and ``lookup`` followed by ``get_many`` (an engine's
  scheduler, then its worker);
* ``open`` + ``lookup`` of a store that lists the prefix at open (``list_on_open``, small prefixes).

Figures are medians; requests (per HTTP method) and round trips (latencies waited in sequence) are
counted at the shim, the round trips once more with every answer :data:`ROUND_TRIP_DELAY` late
(``*_spaced``), where CPU queuing on a busy machine cannot split a wave. On a small machine the local S3
server (moto) spends milliseconds of CPU per request, which the ceilings measured here pay as well.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import torch

from ..backends.layout import object_relpath
from ..keys import ChunkKey
from ..store import open_tiered

Measured = tuple[float, dict[str, Any]]

#: seconds added to each answer while round trips are counted (see ``measure``)
ROUND_TRIP_DELAY = 0.25


def _objects(count: int, size: int) -> list[tuple[ChunkKey, dict[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(size)
    return [(ChunkKey.from_bytes(f"cold-{size}-{i}".encode()),
             {"kv": torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)}) for i in range(count)]


def measure(s3: Any, count: int = 64, size: int = 1 << 20, in_flight: int = 32, latency: float = 0.020,
            bandwidth: float = 90e6, repeats: int = 3, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Cold-instance figures against the local S3 server ``s3`` (a :class:`tierstore.testing.s3.LocalS3`)."""
    import s3fs

    import tierstore

    from ..backends.fsspec import FsspecBackend
    from .s3shim import S3Shim

    items = _objects(count, size)
    keys = [k for k, _ in items]
    url = f"s3://{s3.new_bucket('cold')}/kv"
    log(f"  cold: publishing {count} x {size >> 10} KiB")
    with FsspecBackend(url=url, storage_options=s3.storage_options) as writer:
        if any(writer.write_many([(k, writer.prepare(k, v)) for k, v in items])):
            raise RuntimeError("could not publish the cold prefix")
    paths = [f"{url[len('s3://'):]}/{object_relpath(k)}" for k in keys]
    samples: dict[str, list[Measured]] = {}

    with S3Shim(s3.endpoint_url, latency, bandwidth) as shim:
        options = shim.storage_options({**s3.storage_options,
                                        "config_kwargs": {"max_pool_connections": 2 * in_flight}})

        def config(listed: bool) -> dict[str, Any]:
            return {"tiers": [{"kind": "host", "capacity": 2 * size * count + (64 << 20), "pinned": False},
                              {"kind": "remote", "url": url, "storage_options": options, "list_on_open": listed,
                               "max_in_flight": in_flight}], "prefetch_policy": "transient"}

        def timed(name: str, fn: Callable[[], Any]) -> Any:
            shim.reset()
            t0 = time.perf_counter()
            value = fn()
            seconds = time.perf_counter() - t0
            st = shim.stats()
            samples.setdefault(name, []).append(
                (seconds, {"requests": st["by_method"], "round_trips": st["round_trips"]}))
            return value

        def started_store() -> tierstore.TieredStore:
            """A fresh store whose client is started and whose connections are open (no key of ours seen)."""
            store = open_tiered(config(False))
            # HEADs of other keys on the remote tier's backend: the client starts, connections open, and the
            # store's index learns nothing
            store.tier("remote").backend.stat_many([ChunkKey.from_bytes(b"cold-warm-up-%d" % i)
                                                    for i in range(in_flight)])
            return store

        def lookup_then_load(store: tierstore.TieredStore) -> list[Any]:
            store.lookup(keys)
            return store.get_many(keys)

        def check(got: list[Any]) -> None:
            if any(g is None or not torch.equal(g["kv"], v["kv"]) for g, (_, v) in zip(got, items, strict=True)):
                raise RuntimeError("a cold get_many missed or returned wrong bytes")

        fs = s3fs.S3FileSystem(**options)
        fs.cat_file(paths[0], max_concurrency=1)  # start the client once
        log(f"  cold: lookup and load vs the shim's ceilings, {in_flight} in flight")
        with ThreadPoolExecutor(in_flight) as pool:
            def heads() -> None:
                list(pool.map(lambda p: fs.call_s3("head_object", Bucket=p.split("/", 1)[0],
                                                   Key=p.split("/", 1)[1]), paths))

            def gets() -> None:
                list(pool.map(lambda p: fs.cat_file(p, max_concurrency=1), paths))  # one GET, no HEAD

            for _ in range(repeats):
                timed("head_ceiling", heads)
                timed("get_ceiling", gets)
                with started_store() as store:
                    found = timed("lookup", partial(store.lookup, keys))
                    if found != count:
                        raise RuntimeError(f"cold lookup found {found} of {count}")
                with open_tiered(config(False)) as store:
                    timed("first_lookup", partial(store.lookup, keys))
                with started_store() as store:
                    check(timed("load", partial(store.get_many, keys)))
                with started_store() as store:
                    check(timed("lookup_load", partial(lookup_then_load, store)))
                timed("listed", lambda: _open_lookup(config(True), keys))
            # Round trips as the client sends them: on a busy machine requests sent together reach the
            # shim spread out, and one answered meanwhile would count a trip more; a long first byte
            # keeps each wave together at the shim.
            shim.set_fault("slow", delay=ROUND_TRIP_DELAY)
            with started_store() as store:
                timed("lookup_spaced", partial(store.lookup, keys))
            with started_store() as store:
                check(timed("load_spaced", partial(store.get_many, keys)))
            shim.set_fault("pass")

    res: dict[str, Any] = {"count": count, "size": size, "in_flight": in_flight, "latency_s": latency,
                           "bandwidth_Bps": bandwidth, "repeats": repeats,
                           "round_trip_delay_s": ROUND_TRIP_DELAY}
    for name, runs in samples.items():
        _, details = sorted(runs, key=lambda r: r[0])[len(runs) // 2]  # the median run and its counts
        res[name] = {"s": statistics.median(r[0] for r in runs), **details}
    return res


def _open_lookup(cfg: dict[str, Any], keys: list[ChunkKey]) -> int:
    with open_tiered(cfg) as store:
        return store.lookup(keys)
