"""``tierstore bench mount`` runs end to end on a small disk workload: loads checked byte for byte, figures for
the loads alone and under writes, and bad arguments refused with one line."""

from __future__ import annotations

import json

import pytest

from tierstore.cli import main


def test_the_mount_bench_times_loads_alone_and_under_writes(tmp_path, capsys):
    out = tmp_path / "mount.json"
    assert main(["bench", "mount", "--chunks", "3", "--chunk-mib", "1", "--writers", "2", "--loads", "2",
                 "--repeats", "1", "--dir", str(tmp_path), "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    for label in ("alone", "under_writes"):
        row = res[f"tierstore_{label}"]
        assert 0 < row["load_p50_s"] <= row["load_max_s"]
    assert res["tierstore_under_writes"]["batches_stored_per_s"] > 0
    assert res["tierstore_alone"]["batches_stored_per_s"] == 0
    assert "tierstore  under writes" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == [out]  # its temporary directory is gone


@pytest.mark.parametrize("argv, message", [(["--chunks", "0"], "--chunks"), (["--writers", "-1"], "--writers")])
def test_the_mount_bench_refuses_bad_sizes(argv, message, capsys):
    with pytest.raises(SystemExit) as ei:
        main(["bench", "mount", *argv])
    err = capsys.readouterr().err
    assert ei.value.code == 2 and message in err and err.count("\n") == 1  # a usage error, one line
