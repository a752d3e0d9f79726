"""Long jobs report progress (issue 38): a ``progress(done, total)`` callback on weight loading, publish,
verify and gc, and at the command line a bar on a terminal or plain lines otherwise."""

import io
import json

import torch

import tierstore
import tierstore.weights as tw
from tierstore.cli import main
from tierstore.cliargs import progress_printer
from tierstore.testing.data import chunk, key_of
from tierstore.weights.synth import write_llm_checkpoint


def _calls():
    seen: list[tuple[int, int]] = []
    return seen, lambda done, total: seen.append((done, total))


def _ckpt(tmp_path):
    path = tmp_path / "ckpt"
    write_llm_checkpoint(str(path), 8 << 20, shard_size=3 << 20)
    return path


def test_weight_loads_report_bytes_landed(tmp_path):
    ckpt = _ckpt(tmp_path)
    seen, cb = _calls()
    state = tw.load(ckpt, progress=cb, block_size="1MiB")
    total = sum(t.nbytes for t in state.values())
    assert len(seen) > 1 and seen[-1] == (total, total)
    assert all(a[0] < b[0] and a[1] == b[1] == total for a, b in zip(seen, seen[1:], strict=False))
    params = {n: torch.empty_like(t) for n, t in state.items()}
    seen2, cb2 = _calls()
    tw.load_into(params, ckpt, progress=cb2)
    assert seen2[-1] == (total, total)


def test_publish_reports_progress(tmp_path):
    ckpt = _ckpt(tmp_path)
    seen, cb = _calls()
    tw.publish(ckpt, str(tmp_path / "pub"), progress=cb)
    assert seen and seen[-1][0] == seen[-1][1] > 0


def test_verify_and_gc_show_progress_as_plain_lines_when_not_a_terminal(tmp_path, capsys):
    cfg = tmp_path / "store.json"
    cfg.write_text(json.dumps({"tiers": [{"kind": "disk", "path": str(tmp_path / "disk")}]}))
    with tierstore.open(str(cfg)) as store:
        for i in range(5):
            store.put(key_of(i), chunk(i))
    assert main(["verify", "--config", str(cfg)]) == 0
    assert "verify disk: 5/5 objects (100%)" in capsys.readouterr().err
    assert main(["gc", "--config", str(cfg)]) == 0
    assert "gc disk: 5/5 objects (100%)" in capsys.readouterr().err


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_bar_on_a_terminal_and_lines_in_a_pipe():
    tty = _Terminal()
    show = progress_printer("load", " B", tty)
    for done in (0, 50, 100):
        show(done, 100)
    assert tty.getvalue() == ("\rload [....................]   0% 0/100 B\rload [##########..........]  50% 50/100 B"
                              "\rload [####################] 100% 100/100 B\n")
    pipe = io.StringIO()
    show = progress_printer("load", "", pipe)
    for done in range(0, 101):
        show(done, 100)
    lines = pipe.getvalue().splitlines()
    assert len(lines) == 11 and lines[-1] == "load: 100/100 (100%)"  # one line per tenth, not per call
