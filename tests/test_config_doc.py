"""docs/config.md lists every config key with the default the code uses (issue 38): a key added to the code
but not to the page, a key the page names that the code does not take, or a default that differs fails here."""

from __future__ import annotations

import dataclasses
import enum
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

from tierstore.backends import backend_class
from tierstore.config import _STORE_KEYS, TIER_OPTIONS, MetricsConfig, StoreConfig
from tierstore.errors import ConfigError
from tierstore.keyring import Keyring
from tierstore.serve.client import ServerStore
from tierstore.serve.server import ServeConfig
from tierstore.sizes import parse_duration, parse_size

DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"
REQUIRED = object()  # the code has no default
UNKNOWN = object()  # a default the code computes (not compared)


def doc_tables() -> dict[str, dict[str, str]]:
    """``{section heading: {key: documented default}}`` from the page's tables."""
    tables: dict[str, dict[str, str]] = {}
    section = None
    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
            tables[section] = {}
        elif section and line.startswith("| `"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip("|"))]  # `a \| b` is one cell
            tables[section][cells[0].strip("`")] = cells[2].replace("`", "")
    return tables


def _defaults_of(fn: Any, skip: tuple[str, ...] = ("self", "name")) -> dict[str, Any]:
    return {p.name: REQUIRED if p.default is p.empty else p.default
            for p in inspect.signature(fn).parameters.values() if p.name not in skip}


def _fields(cls: Any) -> dict[str, Any]:
    return {f.name: (f.default if f.default is not dataclasses.MISSING else
                     UNKNOWN if f.default_factory is not dataclasses.MISSING else REQUIRED)
            for f in dataclasses.fields(cls)}


def _tier(kind: str) -> dict[str, Any]:
    init = _defaults_of(backend_class(kind).__init__)
    out = {key: init.get(key, None) for key in TIER_OPTIONS[kind]}  # the store's own keys (capacity) default to none
    if kind == "disk":
        out["compression"] = init["codec"]  # the one name; codec is its alias
    if kind in ("disk", "remote"):
        out["url" if kind == "remote" else "path"] = REQUIRED
    if kind == "remote":
        out["capacity"] = UNKNOWN  # refused
    return out


def _auth_keys() -> set[str]:
    with pytest.raises(ConfigError) as ei:
        Keyring.from_options({"no such key": 1})
    return set(re.search(r"known: ([^)]*)", str(ei.value)).group(1).split(", "))  # type: ignore[union-attr]


def code_tables() -> dict[str, dict[str, Any]]:
    store = {k: v for k, v in _fields(StoreConfig).items()}
    assert set(store) == _STORE_KEYS
    keyring = _fields(Keyring)
    client = _defaults_of(ServerStore.__init__)
    return {
        "Store": store,
        "Every tier": {"kind": REQUIRED, "name": UNKNOWN},
        **{f"`{kind}` tier": _tier(kind) for kind in TIER_OPTIONS},
        "`auth` (remote tier)": {k: keyring.get(k, UNKNOWN) for k in _auth_keys()},
        "`metrics`": _fields(MetricsConfig),
        "Server client": {"server": REQUIRED, "timeout": client["timeout"], "connections": client["connections"]},
        "`serve:` (node server)": _fields(ServeConfig),
    }


def same(documented: str, value: Any) -> bool:
    if value is REQUIRED:
        return documented == "required"
    if value is None or value == frozenset():
        return documented == "none"
    if isinstance(value, bool):
        return documented == str(value).lower()
    if isinstance(value, enum.Enum):
        return documented == value.value
    if isinstance(value, str):
        return documented == value
    for parse in (float, parse_size, parse_duration):
        try:
            return float(parse(documented)) == float(value)  # type: ignore[arg-type]
        except (ValueError, ConfigError):
            continue
    return False


def test_the_page_lists_every_section_and_key_the_code_takes():
    doc, code = doc_tables(), code_tables()
    assert set(code) <= set(doc), f"sections missing from docs/config.md: {set(code) - set(doc)}"
    for section, keys in code.items():
        assert set(doc[section]) == set(keys), (
            f"{section}: missing from the page {sorted(set(keys) - set(doc[section]))}, "
            f"not in the code {sorted(set(doc[section]) - set(keys))}")


def test_every_documented_default_is_the_codes():
    doc, code = doc_tables(), code_tables()
    wrong = {f"{section}.{key}": (doc[section][key], value) for section, keys in code.items()
             for key, value in keys.items() if value is not UNKNOWN and not same(doc[section][key], value)}
    assert not wrong, f"documented default != code default: {wrong}"


def test_the_check_fails_on_a_wrong_default_or_a_missing_key(tmp_path, monkeypatch):
    text = DOC.read_text()
    broken = tmp_path / "config.md"
    broken.write_text(text.replace("| `io_threads` | int ≥ 1 | `4` |", "| `io_threads` | int ≥ 1 | `8` |"))
    monkeypatch.setattr(__import__(__name__), "DOC", broken)
    with pytest.raises(AssertionError, match="disk` tier.io_threads"):
        test_every_documented_default_is_the_codes()
    broken.write_text("\n".join(ln for ln in text.splitlines() if not ln.startswith("| `touch_after`")))
    with pytest.raises(AssertionError, match="touch_after"):
        test_the_page_lists_every_section_and_key_the_code_takes()
