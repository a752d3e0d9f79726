"""``tierstore bench kv`` smoke run at toy scale: every scenario runs, tables print, JSON is complete."""

import json

import pytest

from tierstore import cli


@pytest.mark.slow
def test_bench_kv_small(tmp_path, capsys):
    out = tmp_path / "kv.json"
    rc = cli.main(["bench", "kv", "--kv-volume", "1MiB", "--system-tokens", "64", "--history-tokens", "64",
                   "--user-tokens", "16", "--output-tokens", "16", "--rounds", "2", "--qps", "50",
                   "--chunk-tokens", "32", "--chunk-sizes", "32", "--workdir", str(tmp_path), "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "P50 vs none" in text and "remote/prefill" in text
    res = json.loads(out.read_text())
    by = {r["scenario"]: r for r in res["scenarios"]}
    assert set(by) == {"none", "host", "host+disk", "host+disk+remote"}
    n = res["meta"]["sessions"] * 2
    assert all(r["requests"] == n for r in by.values())
    assert by["none"]["hit_rate"] == 0
    # round 2 of every session extends round 1's prompt: its full chunks come from a lower tier
    assert by["host+disk"]["hit_rate_by_tier"].get("disk", 0) > 0
    assert by["host+disk+remote"]["hit_rate"] > 0
    assert res["chunk_costs"][0]["chunk_tokens"] == 32 and res["chunk_costs"][0]["host_load_s"] > 0


@pytest.mark.slow
def test_bench_kvcopy_small(tmp_path, capsys):
    out = tmp_path / "kvcopy.json"
    rc = cli.main(["bench", "kvcopy", "--tokens", "512", "--layers", "2", "--kv-heads", "2", "--head-dim", "64",
                   "--block-size", "16", "--chunk-tokens", "128", "--repeats", "1", "--threads", "1",
                   "--tiers", "host,disk,server,server-trusted", "--workdir", str(tmp_path), "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "bare_scatter" in text and "bare_gather" in text and "bare_preadv_scatter" in text
    (row,) = json.loads(out.read_text())["results"]
    assert row["tokens"] == 512 and row["bytes"] == 512 * 2 * 2 * 64 * 2 * 2
    assert set(row["host"]) == {"load_into", "bare_scatter", "save_from", "bare_gather"}
    assert set(row["disk"]) == {"load_into", "bare_preadv_scatter"} and all(v > 0 for v in row["disk"].values())
    assert set(row["server"]) == set(row["host"]) and all(v > 0 for v in row["server"].values())
    assert set(row["server-trusted"]) == set(row["host"]) and all(v > 0 for v in row["server-trusted"].values())
    assert "server" in text
