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
