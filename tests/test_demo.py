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
    assert "(1 rounds served by an earlier run's chunks not compared" in proc.stdout  # not a silent "0/0 ✓"
    assert f"under {tmp_path / 'cache'} (kept" in proc.stdout


@pytest.mark.slow
def test_demo_twice_in_a_row_checks_every_round_both_times(tmp_path, capsys, monkeypatch):
    """Without --cache-dir each run starts from a fresh store it removes: the bit-exact check runs on real
    rounds every time (it once read "bit-identical 0/0 ✓" on a second run over a warm ~/.cache)."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # nothing may land under ~/.cache
    for _ in range(2):
        assert cli.main(["demo", *ARGS]) == 0
        lines = capsys.readouterr().out.strip().splitlines()
        assert "a fresh directory, removed at the end" in lines[1] and str(tmp_path) in lines[1]
        assert "bit-identical 3/3," in lines[-1] and "not compared" not in lines[-1]
        table = [ln for ln in lines if ln[:5].strip().isdigit()]
        assert len(table) == 4 and len({len(ln) for ln in table}) == 1  # the columns line up
        assert list(tmp_path.iterdir()) == []


def test_demo_says_slower_below_one():
    from tierstore.demo import _ratio

    assert _ratio(2.94) == "2.9× faster" and _ratio(0.6) == "1.7× slower" and _ratio(1.0) == "1.0× faster"


def test_demo_rejects_bad_arguments(tmp_path, capsys):
    with pytest.raises(SystemExit) as ei:
        cli.main(["demo", "--cache-dir", str(tmp_path), "--rounds", "0"])
    assert ei.value.code == 2
    assert capsys.readouterr().err.strip() == ("tierstore demo: argument --rounds: must be an integer >= 1, got 0 "
                                               "(see `tierstore demo --help`)")
