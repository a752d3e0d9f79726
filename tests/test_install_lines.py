"""The install lines the READMEs give work from a fresh clone: tierstore is not on PyPI, so a line that
installs an adapter must install tierstore from this repository too (``pip install tierstore ./adapters/vllm``
asked the package index for a tierstore it does not have)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
READMES = [ROOT / "README.md", *sorted(ROOT.glob("adapters/*/README.md"))]
_NAME = re.compile(r"^[A-Za-z0-9._-]+")


def _project(path: Path) -> tuple[str, list[str]]:
    meta = tomllib.loads((path / "pyproject.toml").read_text())["project"]
    deps = [_NAME.match(d).group(0).lower() for d in meta.get("dependencies", [])]  # type: ignore[union-attr]
    return meta["name"].lower(), deps


OURS = {_project(p.parent)[0] for p in [ROOT / "pyproject.toml", *ROOT.glob("adapters/*/pyproject.toml")]}


def install_lines(text: str) -> list[str]:
    """Every ``pip install ...`` command in ``text`` (in a code block, or inline between backticks)."""
    out = []
    for m in re.finditer(r"pip install ([^`\n#]*)", text):
        out.append(m.group(1).strip())
    return out


def check(line: str) -> None:
    """Raise AssertionError unless every project of ours that ``line`` needs comes from a local path."""
    given_locally, needed, named = set(), set(), set()
    for arg in shlex.split(line):
        if arg.startswith("-"):
            continue
        target = arg.split("[")[0]
        if target.startswith((".", "/")):
            name, deps = _project((ROOT / target).resolve())
            given_locally.add(name)
            needed.update(d for d in deps if d in OURS)
        elif _NAME.match(target) and _NAME.match(target).group(0).lower() in OURS:  # type: ignore[union-attr]
            named.add(target.lower())
    assert not named, f"`pip install {line}` asks the package index for {sorted(named)}, which is not on it"
    missing = needed - given_locally
    assert not missing, f"`pip install {line}` needs {sorted(missing)} from this repository (add its path)"


@pytest.mark.parametrize("readme", READMES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_install_line_installs_our_projects_from_the_repository(readme):
    lines = [line for line in install_lines(readme.read_text()) if "adapters/" in line or "'.[" in line]
    for line in lines:
        check(line)


def test_the_adapter_install_lines_are_there():
    assert any("./adapters/vllm" in line for line in install_lines((ROOT / "adapters/vllm/README.md").read_text()))
    assert any("./adapters/sglang" in line for line in install_lines((ROOT / "adapters/sglang/README.md").read_text()))


def test_the_check_catches_the_line_that_failed():
    with pytest.raises(AssertionError, match="package index"):
        check("tierstore ./adapters/vllm")
    with pytest.raises(AssertionError, match="from this repository"):
        check("./adapters/sglang")
    check("'.[s3]' ./adapters/vllm")
