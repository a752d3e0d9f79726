"""tierstore's metrics on a real vLLM OpenAI server's own /metrics, scraped by a real Prometheus.

Engine A (offline) computes a 300-token prefix and saves it to disk; an API server B with a copy of that
disk directory (vLLM's prefix cache on, as users run it) gets the same prompt; PromQL over B's /metrics then
gives a token hit rate > 0 for the disk tier that served it.
"""

from __future__ import annotations

import os
import shutil

import pytest
from engine_helpers import ApiServer, kv_config, prompt, run_engine

from tierstore.testing.prometheus import INSTALL_HINT, Prometheus, values
from tierstore.testing.s3 import free_port

pytest.importorskip("vllm")

PREFIX = prompt(1, 300)
CHUNK = 256


def tiers(path) -> list[dict]:
    return [{"kind": "host", "capacity": "64MiB"}, {"kind": "disk", "path": str(path), "capacity": "256MiB"}]


def test_token_hit_rate_per_tier_on_vllms_metrics(tiny_model, tmp_path):
    if shutil.which("prometheus") is None:
        if os.environ.get("TIERSTORE_REQUIRE_PROMETHEUS") == "1":
            pytest.fail(f"prometheus not found: {INSTALL_HINT}")
        pytest.skip(f"prometheus not found: {INSTALL_HINT}")
    disk_a = tmp_path / "a" / "disk"
    a = run_engine({"model": tiny_model, "prompts": [PREFIX + [11, 12, 13]], "kv": kv_config(tiers(disk_a))})
    assert a["results"][0]["cached"] == 0
    disk_b = shutil.copytree(disk_a, tmp_path / "b" / "disk")
    port = free_port()
    with ApiServer(tiny_model, port, kv=kv_config(tiers(disk_b)), log=tmp_path / "server.log") as server, \
            Prometheus([f"127.0.0.1:{port}"]) as prom:
        server.complete(prompt(7, 40))  # a first request: every tierstore series is reported, at 0
        try:
            prom.wait_for('tierstore_kv_hit_tokens_total{tier="disk"}', lambda r: len(r) == 1, timeout=60)
        except TimeoutError:
            raise AssertionError(server.log_tail()) from None
        out = server.complete(PREFIX + [11, 12, 13])
        assert out["choices"][0]["text"] is not None
        rate = ('sum by (tier) (increase(tierstore_kv_hit_tokens_total[1m])) / ignoring(tier) group_left '
                'sum(increase(tierstore_kv_lookup_tokens_total[1m]))')
        result = prom.wait_for(rate, lambda r: values(r, "tier").get("disk", 0) > 0, timeout=60)
        assert values(result, "tier").get("host", 0) == 0
        hits = prom.query('tierstore_kv_hit_tokens_total{tier="disk"}')
        assert float(hits[0]["value"][1]) == CHUNK  # the one 256-token chunk, counted once per request
        assert {"model_name", "engine"} <= set(hits[0]["metric"])  # vLLM's own labels
        read = values(prom.query("tierstore_read_bytes_total"), "tier")
        assert read["disk"] > 0  # the load really came from the disk tier


def _scrape(url: str) -> dict[str, float]:
    """``/metrics`` as {series with labels: value} for the tierstore families."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("tierstore_"):
            series, _, value = line.rpartition(" ")
            out[series] = float(value)
    return out


def _total(series: dict[str, float], family: str, **labels: str) -> float:
    return sum(v for k, v in series.items()
               if k.startswith(family + "{") and all(f'{n}="{x}"' in k for n, x in labels.items()))


def test_through_a_node_server_the_engine_reports_its_lookups_and_not_the_nodes_tiers(tiny_model, tmp_path):
    """With a node server, lookups run in the scheduler: their token hit rate must reach the engine's /metrics
    (the host tier of the node served the hit), while the node's tier counters are the server's own to report
    (every engine reporting them would count each hit once per engine)."""
    from tierstore.serve.server import NodeServer

    sock = tmp_path / "run" / "ts.sock"
    node = {"tiers": [{"kind": "host", "capacity": "256MiB", "pinned": False}], "serve": {"socket": str(sock)}}
    kv = {**kv_config([]), "kv_connector_extra_config": {"config": {"server": f"unix://{sock}"}}}
    with NodeServer(node).start() as node_server:
        a = run_engine({"model": tiny_model, "prompts": [PREFIX + [11, 12, 13]], "kv": kv})
        assert a["results"][0]["cached"] == 0
        assert node_server.store.stats()["tiers"]["host"]["objects"] >= 1
        port = free_port()
        with ApiServer(tiny_model, port, kv=kv, log=tmp_path / "server.log") as server:
            server.complete(prompt(7, 40))
            out = server.complete(PREFIX + [11, 12, 13])
            assert out["choices"][0]["text"] is not None
            got: dict[str, float] = {}
            for _ in range(60):  # the step's stats reach /metrics with the next engine step or two
                got = _scrape(server.url)
                if _total(got, "tierstore_kv_hit_tokens_total", tier="host") >= CHUNK:
                    break
                server.complete(prompt(8, 8), max_tokens=1)
            assert _total(got, "tierstore_kv_hit_tokens_total", tier="host") == CHUNK, server.log_tail()
            assert _total(got, "tierstore_kv_lookup_tokens_total") >= len(PREFIX) + 3
            assert _total(got, "tierstore_read_bytes_total") == 0  # the node's tiers: not this engine's series
