"""Every verb's bad input is one line on stderr and exit status 2, never a traceback (issue 38).

Missing and broken configs, a disk directory another open store holds, files that exist or cannot be
written, and numbers that would make a verb check nothing or spin are all refused before any work.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import tierstore
from tierstore import cli

REPO = Path(tierstore.__file__).resolve().parent.parent
CONFIG_VERBS = [["stats"], ["verify"], ["verify", "--repair"], ["gc"], ["demo"], ["serve"]]


def run_cli(capsys, argv: list[str]) -> tuple[int, str]:
    """Run ``tierstore argv`` in this process: (exit status, stderr); any exception fails the test."""
    capsys.readouterr()
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # argparse and the verbs' own refusals
        code = exc.code if isinstance(exc.code, int) else (print(exc.code, file=sys.stderr) or 1)
    return code, capsys.readouterr().err


def assert_one_line(code: int, err: str, verb: str, *words: str) -> None:
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"tierstore {verb}"), err
    for w in words:
        assert w in lines[0], err


@pytest.fixture
def broken_yaml(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("tiers:\n  - {kind: host, capacity: 1MiB\n")
    return path


@pytest.mark.parametrize("verb", CONFIG_VERBS, ids=" ".join)
def test_missing_config(verb, tmp_path, capsys):
    missing = tmp_path / "nope.yaml"
    assert_one_line(*run_cli(capsys, [*verb, "--config", str(missing)]), verb[0], str(missing), "cannot be read")


@pytest.mark.parametrize("verb", CONFIG_VERBS, ids=" ".join)
def test_broken_yaml(verb, broken_yaml, capsys):
    assert_one_line(*run_cli(capsys, [*verb, "--config", str(broken_yaml)]), verb[0], "not valid YAML")


@pytest.mark.parametrize("verb", CONFIG_VERBS, ids=" ".join)
def test_a_config_that_is_a_directory_or_not_a_mapping(verb, tmp_path, capsys):
    assert_one_line(*run_cli(capsys, [*verb, "--config", str(tmp_path)]), verb[0], "cannot be read")
    bad = tmp_path / "five.yaml"
    bad.write_text("tiers: 5\n")
    assert_one_line(*run_cli(capsys, [*verb, "--config", str(bad)]), verb[0], "tiers")


def test_a_directory_another_store_holds(tmp_path, capsys):
    cfg = tmp_path / "store.json"
    cfg.write_text(json.dumps({"tiers": [{"kind": "host", "capacity": "4MiB", "pinned": False},
                                         {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "16MiB"}]}))
    with tierstore.open(str(cfg)):  # an engine owns the directory
        for verb in (["gc"], ["verify", "--repair"], ["demo", "--rounds", "1"]):
            code, err = run_cli(capsys, [*verb, "--config", str(cfg)])
            assert_one_line(code, err, verb[0], "in use by", "stop that process first")
            assert "read_only=True" not in err  # the Python hint has a CLI form here
        socket = tmp_path / "s.sock"
        code, err = run_cli(capsys, ["serve", "--config", str(cfg), "--socket", str(socket)])
        assert_one_line(code, err, "serve", "in use by")
        assert run_cli(capsys, ["stats", "--config", str(cfg)])[0] == 0  # read-only verbs work beside it


@pytest.mark.parametrize("argv", [
    ["crashtest", "--kills", "0"], ["crashtest", "--kills", "-3"], ["crashtest", "--minutes", "0"],
    ["crashtest", "--threads", "0"], ["crashtest", "--keys", "0"], ["crashtest", "--minutes", "nan"],
    ["gc", "--watch", "0"], ["gc", "--watch", "0.0001"], ["gc", "--max-size", "lots"], ["gc", "--grace", "-5"],
    ["bench", "tiers", "--chunk", "0"], ["bench", "tiers", "--count", "0"], ["bench", "tiers", "--chunk", "lots"],
    ["bench", "tiers", "--repeats", "0"], ["bench", "weights", "--repeat", "0"], ["bench", "metrics", "--count", "0"],
    ["demo", "--rounds", "0"], ["demo", "--chunk-tokens", "-1"], ["demo", "--system-tokens", "x"],
], ids=" ".join)
def test_out_of_range_numbers_refuse_to_run(argv, capsys):
    code, err = run_cli(capsys, argv)
    verb = " ".join(a for a in argv[:2] if not a.startswith("-"))
    assert_one_line(code, err, verb, f"argument {next(a for a in argv if a.startswith('--'))}")


def test_crashtest_with_unknown_configs_leaves_no_temp_dir(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", None)
    code, err = run_cli(capsys, ["crashtest", "--configs", "nonsense", "--kills", "1"])
    assert_one_line(code, err, "crashtest", "unknown config 'nonsense'")
    assert list(tmp_path.iterdir()) == []


def test_files_that_exist_or_cannot_be_written(tmp_path, capsys):
    keys = tmp_path / "keys"
    assert run_cli(capsys, ["keygen", "--out", str(keys)])[0] == 0
    assert_one_line(*run_cli(capsys, ["keygen", "--out", str(keys)]), "keygen", "exists", str(keys))
    assert_one_line(*run_cli(capsys, ["keygen", "--tenant", "a", "--keys", str(tmp_path / "none")]), "keygen")
    cfg = tmp_path / "store.json"
    cfg.write_text(json.dumps({"tiers": [{"kind": "disk", "path": str(tmp_path / "disk")}]}))
    assert_one_line(*run_cli(capsys, ["stats", "--config", str(cfg), "--json", str(tmp_path / "no" / "x.json")]),
                    "stats", "No such file or directory")
    assert_one_line(*run_cli(capsys, ["crashtest", "--kills", "1", "--dir", "/proc/tierstore-x"]), "crashtest")


def test_verbose_after_the_verb_shows_the_traceback(tmp_path, capsys):
    with pytest.raises(tierstore.ConfigError, match="cannot be read"):
        cli.main(["stats", "--config", str(tmp_path / "nope.yaml"), "-v"])
    with pytest.raises(tierstore.ConfigError):
        cli.main(["-v", "stats", "--config", str(tmp_path / "nope.yaml")])


def test_python_m_tierstore_version_help_and_a_missing_adapter(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("TIERSTORE_CONFIG", None)

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "tierstore", *argv], capture_output=True, text=True, env=env,
                              timeout=120, cwd=tmp_path)

    assert run("--version").stdout.strip() == f"tierstore {tierstore.__version__}"
    top = run("--help").stdout
    assert "tensor store over GPU, host, disk and remote" in top and "``" not in top
    proc = run("stats", "--config", str(tmp_path / "nope.yaml"))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    try:
        import tierstore_vllm  # noqa: F401
    except ImportError:
        proc = run("bench", "vllm", "--help")
        assert proc.returncode != 0 and "pip install ./adapters/vllm" in proc.stderr
        assert "Traceback" not in proc.stderr


def test_config_messages_say_where_the_path_came_from_and_where_the_mistake_is(tmp_path, capsys, monkeypatch,
                                                                               broken_yaml):
    monkeypatch.setenv("TIERSTORE_CONFIG", str(tmp_path / "nope.yaml"))
    assert_one_line(*run_cli(capsys, ["stats"]), "stats", "(from $TIERSTORE_CONFIG) cannot be read")
    code, err = run_cli(capsys, ["stats", "--config", str(broken_yaml)])
    assert_one_line(code, err, "stats", str(broken_yaml), "line 3, column 1")
    assert "<unicode string>" not in err


def test_stats_of_a_config_without_persistent_tiers_says_so(tmp_path, capsys):
    cfg = tmp_path / "host.json"
    cfg.write_text(json.dumps({"tiers": [{"kind": "host", "capacity": "1MiB"}]}))
    for verb in ("stats", "verify", "gc"):
        assert run_cli(capsys, [verb, "--config", str(cfg)])[0] == 0
    assert main_out(capsys, ["stats", "--config", str(cfg)]).startswith("no disk or remote tier in this config")


def main_out(capsys, argv: list[str]) -> str:
    capsys.readouterr()
    cli.main(argv)
    return capsys.readouterr().out


def test_a_metrics_port_in_use(tmp_path, capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = tmp_path / "m.json"
        cfg.write_text(json.dumps({"tiers": [{"kind": "host", "capacity": "64MiB"}], "metrics": {"port": port}}))
        code, err = run_cli(capsys, ["demo", "--config", str(cfg), "--rounds", "1"])
    assert_one_line(code, err, "demo", f"cannot serve on 127.0.0.1:{port}")


def test_ctrl_c_ends_a_watching_gc_in_one_line(tmp_path):
    import signal
    import time

    cfg = tmp_path / "store.json"
    cfg.write_text(json.dumps({"tiers": [{"kind": "remote", "url": (tmp_path / "shared").as_uri()}]}))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "tierstore", "gc", "--config", str(cfg), "--watch", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert "remote:" in proc.stdout.readline()  # the first pass is done
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130 and err.strip() == "tierstore gc: interrupted", err
