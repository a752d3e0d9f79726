"""``tierstore demo`` end to end through the CLI, on a store in a tmp dir (never ~/.cache)."""

import json
import os
import subprocess
import sys
from itertools import pairwise

import pytest

from tierstore import cli

ARGS = ["--rounds", "4", "--system-tokens", "192", "--user-tokens", "40", "--answer-tokens", "4",
        "--chunk-tokens", "32"]


@pytest.mark.slow
def test_demo_runs_and_every_round_checks_out(tmp_path, capsys):
    out_json = tmp_path / "demo.json"
    assert cli.main(["demo", "--cache-dir", str(tmp_path / "cache"), *ARGS, "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "bit-exact" in text and "engine restarted" in text
    summary = text.strip().splitlines()[-1]
    assert summary.startswith("✓ 4 rounds") and "bit-identical 3/3" in summary
    rounds = json.loads(out_json.read_text())["rounds"]
    assert rounds[0]["cached_tokens"] == 0 and rounds[0]["bit_identical"] is None
    for prev, r in pairwise(rounds):
        # everything up to the last full chunk of the previous prompt is served from the cache
        assert r["cached_tokens"] == prev["prompt_tokens"] // 32 * 32
        assert r["bit_identical"] and r["within_tolerance"]
    assert rounds[1]["tiers"] == {"host": rounds[1]["cached_tokens"]}
    assert rounds[2]["tiers"] == {"disk": rounds[2]["cached_tokens"]}  # first round after the restart

    # a second run (another process, fresh interpreter hash seed) finds the system prompt on disk
    env = {**os.environ, "PYTHONHASHSEED": "777"}
    proc = subprocess.run([sys.executable, "-m", "tierstore.cli", "demo", "--cache-dir", str(tmp_path / "cache"),
                           *ARGS[:1], "1", *ARGS[2:], "--json", str(out_json)], env=env, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    again = json.loads(out_json.read_text())["rounds"][0]
    # the whole first prompt (232 tokens) except its partial last chunk, from disk; the bit-exact check
    # needs this process's own KV, which a fresh run does not have
    assert again["tiers"] == {"disk": 224} and again["bit_identical"] is None and again["within_tolerance"]


def test_demo_rejects_bad_arguments(tmp_path):
    with pytest.raises(SystemExit) as ei:
        cli.main(["demo", "--cache-dir", str(tmp_path), "--rounds", "0"])
    assert isinstance(ei.value.code, str) and "must be positive" in ei.value.code  # exit status 1
