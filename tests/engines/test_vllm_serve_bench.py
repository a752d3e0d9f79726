"""``tierstore bench serve`` against a real vLLM API server with the TierstoreConnector: streamed TTFT per
request, conversations that carry their answers into the next round, token hit rates read from /metrics."""

from __future__ import annotations

import json

import pytest
from engine_helpers import ApiServer, kv_config

from tierstore.bench.serve import Workload, measure, summarize, table
from tierstore.cli import main
from tierstore.testing.s3 import free_port

pytest.importorskip("vllm")


def test_multi_round_qa_against_a_real_server(tiny_model, tmp_path, capsys):
    tiers = [{"kind": "host", "capacity": "64MiB"}, {"kind": "disk", "path": str(tmp_path / "disk")}]
    with ApiServer(tiny_model, free_port(), kv=kv_config(tiers), log=tmp_path / "server.log") as server:
        w = Workload(users=2, rounds=3, system_words=40, history_words=15, question_words=4, answer_tokens=8)
        res = measure(server.url, tiny_model, w, [4.0], [server.url + "/metrics"], timeout=300)
        assert len(res.records) == 6 and not [r.error for r in res.records if r.error]
        for r in res.records:
            assert r.ttft_s is not None and 0 < r.ttft_s <= r.latency_s and r.text and r.output_tokens >= 1
        for user in range(2):  # each round's prompt holds the previous round's prompt and answer
            mine = sorted((r for r in res.records if r.user == user), key=lambda r: r.round)
            assert [r.round for r in mine] == [1, 2, 3]
            assert all(a.prompt_tokens < b.prompt_tokens for a, b in zip(mine, mine[1:], strict=False))
        rates = res.hit_rates[4.0]
        assert "vllm prefix cache" in rates and 0 < rates["vllm prefix cache"] <= 1  # the shared system prompt
        assert {r["round"] for r in summarize(res.records)} == {"1", "2", "3", "2+"}
        assert "| 4 | 2+ | 4 | 0 |" in table(res)

        out = tmp_path / "serve.json"
        assert main(["bench", "serve", "--url", server.url, "--model", tiny_model, "--users", "1", "--rounds", "2",
                     "--system-words", "30", "--history-words", "5", "--question-words", "3", "--answer-tokens", "4",
                     "--qps", "2,4", "--metrics-url", server.url + "/metrics", "--json", str(out)]) == 0
        printed = capsys.readouterr().out
        assert "TTFT P50 ms" in printed and "token hit rate" in printed
        saved = json.loads(out.read_text())
        assert [r["qps"] for r in saved["records"]].count(2.0) == 2 and set(saved["hit_rates"]) == {"2.0", "4.0"}
