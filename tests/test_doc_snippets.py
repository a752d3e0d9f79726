"""Every Python snippet in README.md and docs/ runs as written on this machine (issue 38), as
tests/test_install_lines.py checks the install lines.

A page's snippets run in order in one namespace, as a reader follows the page, in a scratch directory with
``HOME`` and ``TMPDIR`` inside it (the embedded default store lands there). A snippet followed by a ``text``
block must print exactly that. A snippet that needs an engine or a GPU is marked on the line before it with
``<!-- skip-snippet: <reason naming the engine or GPU it needs> -->``; nothing else is skipped.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_BLOCK = re.compile(r"(?P<before>[^\n]*)\n```python\n(?P<code>.*?)\n```\n(?:```text\n(?P<out>.*?)\n```\n)?", re.S)
_SKIP = re.compile(r"<!-- skip-snippet: (?P<reason>.+?) -->")

RUNNER = r"""
import contextlib, io, json, sys, traceback
blocks = json.load(open(sys.argv[1]))
ns = {"__name__": "__main__"}
for b in blocks:
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(b["code"], b["where"], "exec"), ns)
    except BaseException:
        sys.exit(f"{b['where']} failed:\n{traceback.format_exc()}")
    if b["expect"] is not None and out.getvalue().strip() != b["expect"].strip():
        sys.exit(f"{b['where']} printed:\n{out.getvalue()}\ninstead of:\n{b['expect']}")
"""


def snippets(page: Path) -> tuple[list[dict[str, object]], list[str]]:
    """The page's runnable snippets (code, where, expected output) and the reasons of the skipped ones."""
    text = page.read_text()
    run, skipped = [], []
    for m in _BLOCK.finditer(text):
        line = text.count("\n", 0, m.start("code")) + 1
        where = f"{page.relative_to(ROOT)}:{line}"
        skip = _SKIP.search(m.group("before"))
        if skip:
            skipped.append(f"{where}: {skip.group('reason')}")
            continue
        run.append({"code": m.group("code"), "where": where, "expect": m.group("out")})
    return run, skipped


def test_every_skip_names_an_engine_or_a_gpu():
    for page in PAGES:
        for reason in snippets(page)[1]:
            assert re.search(r"engine|GPU|CUDA|vLLM|SGLang", reason), reason


def test_the_readme_has_a_short_quickstart_with_its_output():
    text = (ROOT / "README.md").read_text()
    head = text.split("\n## Quickstart", 1)[1].split("\n## ", 1)[0]
    m = _BLOCK.search(head)
    assert m and m.group("out"), "the quickstart shows its output in a ```text block"
    assert len(m.group("code").splitlines()) <= 15
    assert text.index("make demo") < text.index("## Install") < text.index("## Quickstart") < text.index("## Trust")


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if snippets(p)[0]], ids=lambda p: str(p.relative_to(ROOT)))
def test_snippets_run_as_written(page, tmp_path):
    blocks, _ = snippets(page)
    (tmp_path / "home").mkdir()
    (tmp_path / "tmp").mkdir()
    spec = tmp_path / "blocks.json"
    spec.write_text(json.dumps(blocks))
    env = {**os.environ, "HOME": str(tmp_path / "home"), "TMPDIR": str(tmp_path / "tmp"),
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("TIERSTORE_CONFIG", None)
    proc = subprocess.run([sys.executable, "-c", RUNNER, str(spec)], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
