"""``tierstore bench serve``'s workload and statistics (the HTTP side runs against real vLLM servers in
``make test-engines``: tests/engines/test_vllm_serve_bench.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tierstore.bench.qa import Record, Workload, hit_rates, percentile, run_step, summarize


def test_the_workload_is_deterministic_and_shares_only_the_system_prompt():
    w = Workload(users=3, rounds=2, system_words=40, history_words=30, question_words=5, seed=1)
    assert w.system(0) == Workload(users=3, rounds=2, system_words=40, history_words=30, question_words=5,
                                   seed=1).system(0)
    assert w.system(0) != w.system(1)  # each sweep step on fresh conversations
    assert w.opening(0, 0) != w.opening(0, 1) and w.question(0, 0, 1) != w.question(0, 0, 2)
    assert len(w.system(0).split()) == 40 + 2 and len(w.opening(0, 2).split()) == 30 + 3
    assert w.question(0, 1, 2).endswith("\nAnswer:")
    with pytest.raises(ValueError, match="users"):
        Workload(users=0)
    with pytest.raises(ValueError, match="system_words"):
        Workload(system_words=-1)


def test_percentiles_interpolate():
    assert percentile([], 0.5) is None
    assert percentile([3.0], 0.99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert percentile(list(map(float, range(101))), 0.9) == pytest.approx(90.0)


def test_summary_per_round_and_rounds_after_the_first():
    recs = [Record(1.0, u, r, 0.0, ttft_s=float(10 * r + u), latency_s=1.0) for u in range(3) for r in (1, 2, 3)]
    recs.append(Record(1.0, 9, 2, 0.0, error="HTTP 500"))
    rows = {(r["qps"], r["round"]): r for r in summarize(recs)}
    assert rows[(1.0, "1")]["requests"] == 3 and rows[(1.0, "1")]["p50"] == 11.0
    assert rows[(1.0, "2")]["errors"] == 1 and rows[(1.0, "2")]["requests"] == 4
    assert rows[(1.0, "2+")]["requests"] == 7 and rows[(1.0, "2+")]["p50"] == 26.0


def test_hit_rates_over_an_interval():
    before = {"tierstore_kv_lookup_tokens_total": {"": 100.0}, "tierstore_kv_hit_tokens_total": {"host": 50.0},
              "vllm:prefix_cache_queries_total": {"": 10.0}, "vllm:prefix_cache_hits_total": {"": 5.0}}
    after = {"tierstore_kv_lookup_tokens_total": {"": 300.0},
             "tierstore_kv_hit_tokens_total": {"host": 100.0, "remote": 100.0},
             "vllm:prefix_cache_queries_total": {"": 110.0}, "vllm:prefix_cache_hits_total": {"": 30.0}}
    assert hit_rates(before, after) == {"tierstore host": 0.25, "tierstore remote": 0.5, "vllm prefix cache": 0.25}
    assert hit_rates({}, {}) == {}


def test_configurations_compare_against_recompute_and_the_prefix_cache():
    from tierstore.bench.qa import Result
    from tierstore.bench.serve import compare

    w = Workload(users=1, rounds=2)

    def result(r1: float, r2: float, answer: str) -> Result:
        return Result(w, "u", "m", [Record(1.0, 0, 1, 0.0, ttft_s=r1, latency_s=r1, text="a"),
                                    Record(1.0, 0, 2, 0.0, ttft_s=r2, latency_s=r2, text=answer)])
    results = {"recompute": result(4.0, 4.0, "b"), "prefix-cache": result(4.0, 2.0, "b"),
               "tierstore": result(4.0, 0.5, "c")}
    results["recompute"].cross, results["tierstore"].cross = [3.0, 4.0, 5.0], [1.0, 0.5, 2.0]
    text = compare(results)
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in text.splitlines()[2:]}
    # 4 s / 0.5 s, 2 s / 0.5 s; the other instance's prefix: median 1 s against 4 s; one answer differs
    assert rows["tierstore"][3:8] == ["8.00×", "4.00×", "1000", "0.25", "1"]
    assert rows["recompute"][3:8] == ["1.00×", "0.50×", "4000", "1.00", "0"]
    assert rows["prefix-cache"][5:7] == ["-", "-"]  # not probed


def test_the_plot_is_a_png_of_every_configuration(tmp_path):
    pytest.importorskip("matplotlib")
    from tierstore.bench.qa import summarize
    from tierstore.bench.serve import plot

    rows = summarize([Record(1.0, 0, 1, 0.0, ttft_s=2.0), Record(1.0, 0, 2, 0.0, ttft_s=0.5)])
    path = tmp_path / "ttft.png"
    assert plot({"recompute": rows, "tierstore": rows}, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000


def test_the_report_shows_a_saved_deployment_run_and_its_targets(tmp_path):
    """``bench all`` puts the separately run ``bench serve --launch --json`` (serve.json beside the report) into
    BENCHMARKS.md: the command, the comparison table and issue 22's targets, met or missed."""
    import json

    from tierstore.bench.qa import Result
    from tierstore.bench.report import write_report

    w = Workload(users=1, rounds=2)

    def result(r2: float, cross: list[float]) -> dict:
        res = Result(w, "u", "m", [Record(1.0, 0, 1, 0.0, ttft_s=4.0, text="a"),
                                   Record(1.0, 0, 2, 0.0, ttft_s=r2, text="b")], {1.0: {"tierstore host": 0.5}}, cross)
        return res.to_json()

    saved = {"command": "tierstore bench serve --launch recompute,prefix-cache,tierstore-serve", "date": "today",
             "configurations": {"recompute": result(4.0, [4.0]), "prefix-cache": result(2.0, [4.0]),
                                "tierstore-serve": result(0.5, [1.0])}}
    (tmp_path / "serve.json").write_text(json.dumps(saved))
    machine = {"date": "d", "cores": 2, "kernel": "k", "python": "3", "torch": "t", "torch_threads": 2}
    write_report({"sections": {}, "machine": machine, "quick": False, "elapsed_s": 1.0}, str(tmp_path))
    text = (tmp_path / "BENCHMARKS.md").read_text()
    assert saved["command"] in text and "| tierstore-serve | 4000 | 500 | 8.00× | 4.00× | 1000 | 0.25 | 0 | 0 |" in text
    assert "| TTFT P50 rounds 2+ (tierstore-serve) vs recompute | 500 ms vs 4000 ms | 8.00× | ≥ 3× | met |" in text
    assert "| TTFT P50 rounds 2+ (tierstore-serve) vs prefix-cache | 500 ms vs 2000 ms | 4.00× | ≥ 1.5× | met |" in text
    assert "| other instance's prefix (tierstore-serve) ≤ 0.5× recompute | 1000 ms vs 4000 ms | 2.00× | ≥ 1× | met |" \
        in text
    assert "| answers equal to the first configuration's (temperature 0) | 0 of 4 differ | 1.00× | ≥ 1× | met |" in text


def test_prefix_repetition_requests_share_only_their_prefix_and_count_its_uses():
    w = Workload(users=4, rounds=3, system_words=50, question_words=5, seed=2, prefixes=3)
    reqs = w.prefix_requests(0)
    assert reqs == Workload(users=4, rounds=3, system_words=50, question_words=5, seed=2, prefixes=3).prefix_requests(0)
    assert len(reqs) == 12 and {p for p, _, _ in reqs} <= {0, 1, 2}
    for p in {p for p, _, _ in reqs}:
        mine = [(n, prompt) for q, n, prompt in reqs if q == p]
        assert [n for n, _ in mine] == list(range(1, len(mine) + 1))  # 1 = the prefix's first use
        heads = {prompt.split("\n\nRequest")[0] for _, prompt in mine}
        assert len(heads) == 1 and len(next(iter(heads)).split()) == 50 + 2
    assert len({prompt for _, _, prompt in reqs}) == 12  # every suffix fresh


def test_a_prefix_repetition_step_against_an_openai_endpoint():
    import http.server
    import threading

    prompts = []

    class Fake(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - the http.server hook
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            prompts.append(body["prompt"])
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for event in ({"choices": [{"text": " ok"}]}, {"choices": [], "usage": {"prompt_tokens": 7,
                                                                                    "completion_tokens": 1}}):
                self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Fake)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        w = Workload(users=3, rounds=2, system_words=20, question_words=3, answer_tokens=1, prefixes=2)
        records = run_step(f"http://127.0.0.1:{server.server_port}", "m", w, qps=50, sweep=0, timeout=10)
    finally:
        server.shutdown()
    assert len(records) == 6 and not any(r.error for r in records)
    assert sorted(prompts) == sorted(prompt for _, _, prompt in w.prefix_requests(0))
    rows = {r["round"]: r for r in summarize(records)}
    assert rows["1"]["requests"] == len({r.user for r in records})  # one cold request per prefix used
    assert rows["2+"]["requests"] == 6 - rows["1"]["requests"]


def _launch_args(*argv: str):
    import argparse

    from tierstore.bench.serve import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def _launch_plan(env: dict, tmp_path) -> dict[str, list[str]]:
    """Run launch.sh with ``env`` and a stand-in for ``vllm serve`` that writes its arguments and exits once both
    instances have (so the script, stopping when one exits, cannot kill the other first): each instance's
    command line."""
    import json
    import os
    import shutil
    import subprocess
    import sys

    from tierstore.bench.deploy import LAUNCH
    from tierstore.testing.s3 import free_port

    fake = tmp_path / "fake_vllm.py"
    out = tmp_path / "args"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    fake.write_text(f"import json, pathlib, sys, time\nout = pathlib.Path({str(out)!r})\n"
                    "port = sys.argv[sys.argv.index('--port') + 1]\n"
                    "(out / (port + '.tmp')).write_text(json.dumps(sys.argv[1:]))\n"
                    "(out / (port + '.tmp')).rename(out / (port + '.json'))\n"
                    "deadline = time.monotonic() + 20\n"
                    "while len(list(out.glob('*.json'))) < 2 and time.monotonic() < deadline:\n    time.sleep(0.05)\n")
    state = tmp_path / "state"
    ports = {"a": str(free_port()), "b": str(free_port())}
    full = {**os.environ, **env, "VLLM_SERVE": f"{sys.executable} {fake}", "STATE_DIR": str(state),
            "PORT_A": ports["a"], "PORT_B": ports["b"], "READY_TIMEOUT": "30"}
    proc = subprocess.run(["bash", str(LAUNCH)], env=full, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "exited" in proc.stderr, proc.stderr  # the stand-in does not serve
    return {name: json.loads((out / f"{port}.json").read_text()) for name, port in ports.items()}


def _offloading(argv: list[str]) -> dict:
    import json

    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert kv["kv_connector"] == "OffloadingConnector" and kv["kv_role"] == "kv_both"
    extra = kv["kv_connector_extra_config"]
    assert (extra["spec_name"], extra["spec_module_path"]) == ("CPUTieringOffloadingSpec", "tierstore_vllm")
    return extra


@pytest.mark.parametrize("name", ["vllm-fs-tier", "tierstore-tier", "tierstore-tier-once"])
def test_the_tier_configurations_launch_vllm_offloading_on_one_shared_directory(name, tmp_path):
    """``--launch vllm-fs-tier`` / ``tierstore-tier``: both instances run vLLM's OffloadingConnector with a CPU
    tier of ``--cpu-bytes`` and the secondary tier on the same ``file://`` directory (the fs tier's root, the
    tierstore tier's shared tier); the engines' own arguments are kept."""
    from tierstore.bench.serve_launch import deployment_env
    from tierstore.config import read_config

    args = _launch_args("--launch", name, "--cpu-bytes", "256MiB", "--engine-args", "--max-model-len 4096")
    env = deployment_env(name, args, "/models/m", tmp_path / name)
    plans = _launch_plan(env, tmp_path)
    shared = tmp_path / name / "shared"
    tiers = []
    for argv in plans.values():
        assert argv[0] == "/models/m" and argv[argv.index("--max-model-len") + 1] == "4096"
        extra = _offloading(argv)
        assert extra["cpu_bytes_to_use"] == 256 << 20
        [tier] = extra["secondary_tiers"]
        tiers.append(tier)
    assert tiers[0] == tiers[1]  # one directory behind both instances
    if name == "vllm-fs-tier":
        assert tiers[0] == {"type": "fs", "root_dir": str(shared)}
    else:
        assert (tiers[0]["type"], tiers[0]["module_path"]) == ("TierstoreTier", "tierstore_vllm")
        assert set(tiers[0]) == {"type", "module_path", "config"}
        once = {"verify_reads": "once"} if name == "tierstore-tier-once" else {}
        assert read_config(tiers[0]["config"])["tiers"] == [{"kind": "remote", "url": f"file://{shared}", **once}]


def test_without_a_shared_tier_each_instance_keeps_its_own_directory(tmp_path):
    """SHARED=none: the fs tier gets a directory per instance, the tierstore tier a disk tier of DISK_CAPACITY
    (its budget) per instance; vLLM's fs tier cannot take an s3:// tier."""
    plans = _launch_plan({"MODEL": "m", "SHARED": "none", "KV": "vllm-fs-tier"}, tmp_path)
    roots = {n: _offloading(argv)["secondary_tiers"][0]["root_dir"] for n, argv in plans.items()}
    assert roots["a"] != roots["b"] and roots["a"].endswith("fs-a")
    plans = _launch_plan({"MODEL": "m", "SHARED": "none", "KV": "tierstore-tier", "DISK_CAPACITY": "3GiB"}, tmp_path)
    extra = _offloading(plans["b"])
    assert extra["cpu_bytes_to_use"] == 8 << 30  # the default
    assert extra["secondary_tiers"][0]["config"]["tiers"] == [
        {"kind": "disk", "path": str(tmp_path / "state" / "disk-b"), "capacity": "3GiB"}]
    import os
    import subprocess

    from tierstore.bench.deploy import LAUNCH

    proc = subprocess.run(["bash", str(LAUNCH)], env={**os.environ, "MODEL": "m", "SHARED": "s3://b/p",
                                                      "KV": "vllm-fs-tier", "STATE_DIR": str(tmp_path / "s")},
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "vllm-fs-tier takes SHARED=file://" in proc.stderr


def test_the_bench_checks_its_launch_options():
    from tierstore.bench.serve_launch import deployment_env, launch_names

    assert launch_names(_launch_args("--launch", "vllm-fs-tier,tierstore-tier")) == ["vllm-fs-tier", "tierstore-tier"]
    for argv, message in ((["--launch", "tierstore-tier,tierstore-tier"], "named twice"),
                          (["--launch", "fs"], "unknown configuration"),
                          (["--launch", "tierstore-tier", "--repeats", "0"], "--repeats"),
                          (["--launch", "tierstore-tier", "--shared", "/mnt/x"], "--shared"),
                          (["--launch", "vllm-fs-tier,tierstore-tier", "--shared", "s3://b/p"], "needs a file://")):
        with pytest.raises(SystemExit, match=message):
            launch_names(_launch_args(*argv))
    env = deployment_env("tierstore-tier", _launch_args("--launch", "tierstore-tier", "--shared", "s3://b/p"), "m",
                         Path("/tmp/x"))
    assert env["SHARED"] == "s3://b/p" and env["CPU_BYTES_TO_USE"] == str(1 << 30)
    assert deployment_env("tierstore", _launch_args("--shared", "s3://b/p"), "m", Path("/tmp/x"))["SHARED"] == "none"
    with pytest.raises(SystemExit, match="--cpu-bytes"):
        deployment_env("tierstore-tier", _launch_args("--cpu-bytes", "lots"), "m", Path("/tmp/x"))


def test_repeats_alternate_and_every_other_one_runs_in_reverse_order():
    """A B, B A, A B, ...: no configuration always deploys first in its pair (or always right after another's)."""
    from tierstore.bench.serve_launch import launch_order

    names = ["tierstore-tier", "vllm-fs-tier", "tierstore-tier-once"]
    runs = [launch_order(names, rep) for rep in range(4)]
    assert runs == [names, names[::-1], names, names[::-1]]


def test_the_tier_table_compares_the_fs_tier_with_tierstores_and_pools_repeats():
    """TTFT of rounds 2+ (P50, P90) and of the other instance's prefix, the ratios tierstore/fs, the chunk hit
    rates per offloading tier (averaged over repeats), answers differing, bytes stored (median of repeats)."""
    from tierstore.bench.qa import Result, hit_rates
    from tierstore.bench.serve import tier_table

    w = Workload(users=1, rounds=2)

    def result(r2: float, answer: str, hits: float, stored: int) -> Result:
        return Result(w, "u", "m", [Record(1.0, 0, 1, 0.0, ttft_s=4.0, text="a"),
                                    Record(1.0, 0, 2, 0.0, ttft_s=r2, text=answer)],
                      {1.0: {"offload 1:x": hits, "vllm prefix cache": 0.1}}, [r2], [stored])
    fs, ours = result(2.0, "b", 0.5, 3 << 20), result(1.0, "b", 1.0, 1 << 20)
    fs.pool(result(2.0, "b", 1.0, 5 << 20))
    ours.pool(result(3.0, "c", 0.5, 1 << 20))
    assert fs.hit_rates[1.0]["offload 1:x"] == 0.75 and fs.repeats == 2
    text = tier_table({"vllm-fs-tier": fs, "tierstore-tier": ours})
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in text.splitlines()[2:4]}
    assert rows["vllm-fs-tier"][1:6] == ["2000", "2000", "2000", "1:x 75%", "4"]
    assert rows["tierstore-tier"][1:6] == ["2000", "2800", "2000", "1:x 75%", "1"]
    assert "tierstore-tier/fs: TTFT P50 rounds 2+ 1.00, P90 1.40, other instance's prefix 1.00; answers " \
           "differing: 1 of 2" in text
    once = result(1.5, "b", 1.0, 1 << 20)  # a second configuration of ours: a row and a ratio line of its own
    text = tier_table({"vllm-fs-tier": fs, "tierstore-tier": ours, "tierstore-tier-once": once})
    assert [line.split(" | ")[0].strip("| ") for line in text.splitlines()[2:5]] == [
        "vllm-fs-tier", "tierstore-tier", "tierstore-tier-once"]
    assert "tierstore-tier-once/fs: TTFT P50 rounds 2+ 0.75," in text
    before = {"vllm:kv_offload_tiering_chunk_queries_total": {"0:primary": 10.0, "1:fs": 4.0},
              "vllm:kv_offload_tiering_chunk_hits_total": {"0:primary": 2.0}}
    after = {"vllm:kv_offload_tiering_chunk_queries_total": {"0:primary": 30.0, "1:fs": 12.0},
             "vllm:kv_offload_tiering_chunk_hits_total": {"0:primary": 7.0, "1:fs": 6.0}}
    assert hit_rates(before, after) == {"offload 0:primary": 0.25, "offload 1:fs": 0.75}
