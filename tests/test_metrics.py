"""Prometheus metrics: the exposition equals stats(), passes promtool, is scraped by a real Prometheus whose
PromQL gives the token hit rate per tier; failures are logged again after a quiet period."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import tierstore
from tierstore import ConfigError, KVCacheStore, KVNamespace
from tierstore.metrics import TIER_FAMILIES, StoreCollector, exposition
from tierstore.telemetry import Failures
from tierstore.testing.prometheus import INSTALL_HINT, Prometheus, values
from tierstore.testing.s3 import free_port

CHUNK = 4096  # bytes per test chunk (1,024 float32)
#: `make test` sets this: a missing Prometheus/promtool fails the tests that need it instead of skipping them
REQUIRED = os.environ.get("TIERSTORE_REQUIRE_PROMETHEUS") == "1"


def need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        if REQUIRED:
            pytest.fail(f"{tool} not found: {INSTALL_HINT}")
        pytest.skip(f"{tool} not found: {INSTALL_HINT}")
    return path


def config(tmp_path, host=3 * CHUNK, **extra):
    return {"tiers": [{"kind": "host", "capacity": host},
                      {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "1MiB"}], **extra}


def chunk(i: int) -> dict[str, torch.Tensor]:
    return {"x": torch.full((CHUNK // 4,), float(i))}


def key(i: int) -> tierstore.ChunkKey:
    return tierstore.ChunkKey.from_bytes(b"metrics-%d" % i)


def scrape(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``{(sample name, sorted labels): value}`` of a text exposition."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def fetch(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def test_counters_equal_stats_and_the_scripted_workload(tmp_path):
    with tierstore.open(config(tmp_path, metrics={"port": 0})) as store:
        for i in range(5):  # the host tier holds 3: two are evicted to disk (written below first)
            assert store.put(key(i), chunk(i))
        got = store.get_many([key(i) for i in range(5)] + [key(98), key(99)])
        assert sum(g is not None for g in got) == 5
        store.flush()
        st = store.stats()
        samples = scrape(fetch(store.metrics.port))
    # the workload's own numbers
    assert samples[("tierstore_put_keys_total", ())] == 5
    assert samples[("tierstore_get_keys_total", ())] == 7
    assert samples[("tierstore_get_hits_total", ())] == 5
    assert samples[("tierstore_get_misses_total", ())] == 2
    host, disk = (("tier", "host"),), (("tier", "disk"),)
    assert samples[("tierstore_written_bytes_total", host)] >= 5 * CHUNK
    assert samples[("tierstore_evictions_total", host)] >= 2
    assert samples[("tierstore_hits_total", host)] + samples[("tierstore_hits_total", disk)] == 5
    assert samples[("tierstore_used_bytes", host)] <= 3 * CHUNK
    # and every per-tier family equals stats()
    for fam in TIER_FAMILIES:
        suffix = "_total" if fam.kind == "counter" else ""
        for tier, ts in st["tiers"].items():
            if ts.get(fam.stat) is not None and fam.stat != "writeback_lag_s":
                assert samples[(f"tierstore_{fam.name}{suffix}", (("tier", tier),))] == ts[fam.stat], fam.name
    assert samples[("tierstore_get_hits_total", ())] == st["hits"]
    # one histogram observation per batched call: 5 puts and one get_many
    assert samples[("tierstore_op_seconds_count", (("op", "put"),))] == 5
    assert samples[("tierstore_op_seconds_count", (("op", "get"),))] == 1


def test_exposition_passes_promtool(tmp_path):
    promtool = need("promtool")
    with tierstore.open(config(tmp_path)) as store:
        kv = KVCacheStore(store, KVNamespace(model="m", dtype="float32"), chunk_tokens=4)
        kv.save(list(range(8)), [torch.zeros(2, 8, 1, 2)])
        kv.lookup(list(range(8)))
        text = exposition(StoreCollector.of(store))
    run = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, timeout=30)
    assert run.returncode == 0 and not run.stdout.strip() and not run.stderr.strip(), run.stdout + run.stderr


def test_real_prometheus_reads_the_token_hit_rate_per_tier(tmp_path):
    need("prometheus")
    with tierstore.open(config(tmp_path, host="1MiB", metrics={"port": 0})) as store, \
            Prometheus([f"127.0.0.1:{store.metrics.port}"]) as prom:
        kv = KVCacheStore(store, KVNamespace(model="m", dtype="float32"), chunk_tokens=16)
        prompt = list(range(64))
        prom.wait_for('tierstore_kv_lookup_tokens_total', lambda r: len(r) == 1)  # scraped before the lookups
        assert kv.lookup(prompt) == 0
        kv.save(prompt, [torch.randn(2, 64, 2, 8)])
        assert kv.lookup(prompt) == 64  # the repeated prompt: 64 of 64 tokens in the host tier
        rate = ('sum by (tier) (increase(tierstore_kv_hit_tokens_total[1m])) / ignoring(tier) group_left '
                'sum(increase(tierstore_kv_lookup_tokens_total[1m]))')
        result = prom.wait_for(rate, lambda r: values(r, "tier").get("host", 0) > 0)
        by_tier = values(result, "tier")
        assert by_tier["host"] == pytest.approx(0.5, rel=0.2)  # 64 hit of 128 asked (extrapolation aside)
        assert by_tier.get("disk", 0) == 0


def test_metrics_server_errors_and_close(tmp_path):
    with pytest.raises(ConfigError, match="metrics.port"):
        tierstore.open(config(tmp_path, metrics={"port": "9400"}))
    with pytest.raises(ConfigError, match="unknown"):
        tierstore.open(config(tmp_path, metrics={"port": 0, "path": "/x"}))
    port = free_port()
    with tierstore.open(config(tmp_path, metrics={"port": port})) as store:
        assert store.metrics.port == port and "tierstore_hits_total" in fetch(port)
        with pytest.raises(ConfigError, match="cannot serve"):  # the port is taken: a clear error ...
            tierstore.open(config(tmp_path / "second", metrics={"port": port}))
        assert store.put(key(1), chunk(1))  # ... and the first store is untouched
    with pytest.raises(urllib.error.URLError):  # close() stopped the server
        fetch(port)
    again = tierstore.open(config(tmp_path / "second"))  # the failed open left no lock behind
    again.close()


def test_stats_cli_writes_a_textfile(tmp_path):
    with tierstore.open(config(tmp_path)) as store:
        for i in range(4):
            store.put(key(i), chunk(i))
    cfg = tmp_path / "cfg.json"
    cfg.write_text(__import__("json").dumps(config(tmp_path)))
    out = tmp_path / "textfile" / "tierstore.prom"
    out.parent.mkdir()
    run = subprocess.run([sys.executable, "-m", "tierstore.cli", "stats", "--config", str(cfg), "--prometheus",
                          str(out)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    samples = scrape(out.read_text())
    assert samples[("tierstore_objects", (("tier", "disk"),))] == 4
    assert [p.name for p in out.parent.iterdir()] == ["tierstore.prom"]  # no temp file left
    if shutil.which("promtool"):
        assert subprocess.run(["promtool", "check", "metrics"], input=out.read_bytes(), timeout=30).returncode == 0


def test_failures_are_logged_again_after_a_quiet_period(caplog):
    failures = Failures(logging.getLogger("tierstore.test"), "tier t: ", quiet=0.2)
    with caplog.at_level(logging.WARNING, logger="tierstore.test"):
        for _ in range(5):
            failures.report("read", "read failed (%s)", "EIO")
        assert len(caplog.records) == 1  # the first at once, the next four quiet
        time.sleep(0.25)
        failures.report("read", "read failed (%s)", "EIO")
        failures.report("write", "write failed")
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "tier t: read failed (EIO)"
    assert lines[1].startswith("tier t: read failed (EIO) (5 such failures in the last")  # 4 quiet + this one
    assert lines[2] == "tier t: write failed"  # another reason is not held back by the first
    assert failures.counts() == {"read": 6, "write": 1}


def test_a_second_outage_of_a_tier_is_logged_and_counted(tmp_path, caplog):
    """Review #14: each failure kind was logged once per tier lifetime; now again after the quiet period."""
    with tierstore.open({"tiers": [{"kind": "disk", "path": str(tmp_path / "d"), "capacity": "1MiB"}]}) as store:
        tier = store.tiers[0]
        tier.failures.quiet = 0.1

        def damage_and_read(i: int) -> None:
            store.put(key(i), chunk(i))
            path = tier.backend.object_path(key(i))
            with open(path, "r+b") as f:
                f.seek(-8, os.SEEK_END)
                f.write(b"\xff" * 8)
            assert store.get(key(i)) is None  # damaged: a miss, never wrong bytes

        with caplog.at_level(logging.WARNING, logger="tierstore"):
            damage_and_read(1)
            time.sleep(0.15)
            damage_and_read(2)
        assert sum("damaged object" in r.getMessage() for r in caplog.records) == 2
        st = store.stats()["tiers"]["disk"]
        assert st["corrupt"] == 2 and st["failures"]["corrupt"] == 2
        assert scrape(exposition(StoreCollector.of(store)).decode())[
            ("tierstore_failures_total", (("reason", "corrupt"), ("tier", "disk")))] == 2


def test_weight_loads_count_bytes_by_origin(tmp_path):
    from tierstore.weights import load
    from tierstore.weights.synth import write_checkpoint

    write_checkpoint(str(tmp_path / "ckpt"), {"w": torch.randn(64, 64), "b": torch.randn(64)})
    with tierstore.open(config(tmp_path, host="4MiB")) as store:
        first = load(str(tmp_path / "ckpt"), store=store)
        second = load(str(tmp_path / "ckpt"), store=store)
        assert all(torch.equal(first[k], second[k]) for k in first)
        weights = store.stats()["counters"]["weights_bytes"]
    assert weights["source"] > 0 and weights["cache"] == weights["source"]  # the second load: all from cache


def test_the_dashboard_parses_and_names_only_exported_metrics(tmp_path):
    """Every panel expression of docs/ops/grafana-dashboard.json is valid PromQL and uses our families."""
    import json
    import re
    from pathlib import Path

    promtool = need("promtool")
    dash = json.loads((Path(__file__).parents[1] / "docs" / "ops" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"].replace("$__rate_interval", "5m") for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 10
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"tierstore:panel{i}", "expr": e}
                                                          for i, e in enumerate(exprs)]}]}
    path = tmp_path / "rules.yml"
    path.write_text(json.dumps(rules))
    run = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stdout + run.stderr
    cfg = config(tmp_path, metrics={"port": 0})
    cfg["tiers"].append({"kind": "remote", "url": f"file://{tmp_path}/remote"})
    with tierstore.open(cfg) as store:
        KVCacheStore(store, KVNamespace(model="m", dtype="float32"), chunk_tokens=4).lookup([1, 2, 3, 4])
        store.counters.add("weights_bytes", 1, "cache")
        text = fetch(store.metrics.port)
    exported = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    exported |= {name for name, _ in scrape(text)}  # histograms: _bucket, _count, _sum
    used = {m for e in exprs for m in re.findall(r"tierstore_[a-z_]+", e)}
    assert used <= exported, used - exported


def test_idle_connections_to_the_endpoint_cost_no_thread_and_scrapes_go_on(tmp_path):
    """Reliability probe 5.9: 600 idle connections made 600 threads in the store's process."""
    import socket
    import threading

    with tierstore.open(config(tmp_path, metrics={"port": 0})) as store:
        assert store.metrics.host == "127.0.0.1"  # loopback unless host says otherwise
        before = threading.active_count()
        idle = [socket.create_connection(("127.0.0.1", store.metrics.port)) for _ in range(200)]
        time.sleep(0.5)
        assert threading.active_count() <= before + 4
        for s in idle:
            s.close()
        deadline = time.monotonic() + 10
        while True:  # the idle ones that took a worker give it back within the request timeout
            try:
                assert "tierstore_put_keys_total" in fetch(store.metrics.port)
                break
            except (urllib.error.URLError, ConnectionError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        assert threading.active_count() <= before + 4
