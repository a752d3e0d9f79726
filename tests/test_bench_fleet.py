"""``tierstore bench fleet`` smoke run: instances share a prefix through the shim, the gc sidecar holds it."""

from __future__ import annotations

from tierstore.bench import fleet


def test_a_small_fleet_shares_the_system_prompt_and_gc_holds_the_budget(s3_server):
    rows = fleet.measure(s3_server, [3], users=1, rounds=3, chunk_tokens=64, latency=0.0, gc_every=0.3)
    (r,) = rows
    assert r["requests"] == 9 and r["hit_rate"] > 0.5  # rounds >= 2 reuse the system prompt and the history
    assert r["gc_passes"] >= 1 and r["lists_per_pass"] >= 1
    assert r["bytes_after_max"] <= 1.1 * r["budget"]
    assert r["elapsed_s"] >= (9 - 1) / fleet.RATE  # paced: the fleet's 9 requests at RATE a second
    assert "| 3 | 8 | 9 |" in fleet.table(rows)
