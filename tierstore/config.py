"""Store configuration: parsing and validating the user's dict / YAML / JSON before anything is built.

Every mistake raises :class:`ConfigError` naming the offending key (``tiers[1].capacity``), and nothing is
written to storage until the whole configuration has been checked.
"""

from __future__ import annotations

import enum
import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .sizes import parse_size

ENV_CONFIG = "TIERSTORE_CONFIG"
DEFAULT_ROOT = "~/.cache/tierstore"


class WritePolicy(str, enum.Enum):
    WRITE_BACK = "write_back"
    WRITE_THROUGH = "write_through"


class PrefetchPolicy(str, enum.Enum):
    RETAIN = "retain"
    TRANSIENT = "transient"


# Keys each tier kind accepts, and which of them are byte sizes.
_TIER_KEYS: dict[str, set[str]] = {
    "device": {"device", "capacity"},
    "host": {"capacity", "pinned", "pool", "slot_size"},
    "disk": {"path", "capacity", "durable", "read_only", "codec", "io_threads"},
    "remote": {"url", "storage_options", "compression", "capacity", "max_in_flight", "list_on_open"},
}
_SIZE_KEYS = {"capacity", "slot_size"}
_REQUIRED = {"disk": {"path"}, "remote": {"url"}}
_STORE_KEYS = {"tiers", "write_policy", "prefetch_policy", "max_in_flight", "close_timeout"}


@dataclass(frozen=True)
class TierConfig:
    kind: str
    name: str
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StoreConfig:
    tiers: tuple[TierConfig, ...]
    write_policy: WritePolicy = WritePolicy.WRITE_BACK
    prefetch_policy: PrefetchPolicy = PrefetchPolicy.RETAIN
    max_in_flight: int = 8
    close_timeout: float = 10.0  # seconds close() (and the flush at exit) waits for write-back


def default_config(root: str = DEFAULT_ROOT) -> dict:
    """The embedded default: a host tier and a disk tier under ``root``, sized from free RAM and disk."""
    path = Path(os.path.expanduser(root))
    try:
        avail_ram = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        avail_ram = 4 << 30
    free_disk = shutil.disk_usage(_existing_ancestor(path)).free
    return {
        "tiers": [
            {"kind": "host", "capacity": max(64 << 20, min(avail_ram // 4, 8 << 30))},
            {"kind": "disk", "path": str(path / "disk"), "capacity": max(256 << 20, min(free_disk // 2, 64 << 30))},
        ],
        "write_policy": "write_back",
        "prefetch_policy": "retain",
    }


def read_config(config: Mapping | str | os.PathLike | None) -> dict:
    """Turn ``None`` (``$TIERSTORE_CONFIG`` or the default), a path or a mapping into a plain dict."""
    if config is None:
        config = os.environ.get(ENV_CONFIG) or None
        if config is None:
            return default_config()
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        path = Path(config).expanduser()
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigError(f"config file {str(path)!r} cannot be read: {exc}") from None
        try:
            if path.suffix.lower() == ".json":
                data = json.loads(text)
            else:
                import yaml
                data = yaml.safe_load(text)
        except Exception as exc:  # yaml and json raise different types; both mean a bad file
            raise ConfigError(f"config file {str(path)!r} is not valid YAML/JSON: {exc}") from None
        if not isinstance(data, Mapping):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top level")
        return dict(data)
    raise ConfigError(f"config must be a mapping, a file path or None, got {type(config).__name__}")


def parse_config(config: Mapping | str | os.PathLike | None = None) -> StoreConfig:
    """Validate a configuration and return it as a :class:`StoreConfig`."""
    raw = read_config(config)
    unknown = set(raw) - _STORE_KEYS
    if unknown:
        raise ConfigError(f"unknown config key(s): {', '.join(sorted(unknown))}")
    tiers_raw = raw.get("tiers")
    if not isinstance(tiers_raw, list) or not tiers_raw:
        raise ConfigError("tiers: expected a non-empty list of tier entries")
    tiers, names = [], set()
    for i, entry in enumerate(tiers_raw):
        tier = _parse_tier(entry, f"tiers[{i}]")
        if tier.name in names:
            raise ConfigError(f"tiers[{i}].name: duplicate tier name {tier.name!r} (give each a name:)")
        names.add(tier.name)
        tiers.append(tier)
    return StoreConfig(
        tiers=tuple(tiers),
        write_policy=_enum(WritePolicy, raw.get("write_policy", "write_back"), "write_policy"),
        prefetch_policy=_enum(PrefetchPolicy, raw.get("prefetch_policy", "retain"), "prefetch_policy"),
        max_in_flight=_positive_int(raw.get("max_in_flight", 8), "max_in_flight"),
        close_timeout=_seconds(raw.get("close_timeout", 10.0), "close_timeout"),
    )


def _enum(cls, value, key: str):
    try:
        return cls(value)
    except ValueError:
        allowed = " | ".join(m.value for m in cls)
        raise ConfigError(f"{key}: {value!r} is not one of {allowed}") from None


def _positive_int(value, key: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{key}: expected a positive integer, got {value!r}")
    return value


def _seconds(value, key: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < float("inf"):
        raise ConfigError(f"{key}: expected a non-negative number of seconds, got {value!r}")
    return float(value)


def _parse_tier(entry, where: str) -> TierConfig:
    if not isinstance(entry, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {type(entry).__name__}")
    kind = entry.get("kind")
    if kind not in _TIER_KEYS:
        raise ConfigError(f"{where}.kind: unknown tier kind {kind!r} (one of {', '.join(_TIER_KEYS)})")
    options = {k: v for k, v in entry.items() if k not in ("kind", "name")}
    unknown = set(options) - _TIER_KEYS[kind]
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) for a {kind} tier: {', '.join(sorted(unknown))}")
    missing = _REQUIRED.get(kind, set()) - set(options)
    if missing:
        raise ConfigError(f"{where}: a {kind} tier needs {', '.join(sorted(missing))}")
    for key in _SIZE_KEYS & set(options):
        if options[key] is not None:
            options[key] = parse_size(options[key], key=f"{where}.{key}")
    if "max_in_flight" in options:
        _positive_int(options["max_in_flight"], f"{where}.max_in_flight")
    if kind == "disk":
        options["path"] = _check_writable(options["path"], f"{where}.path",
                                          read_only=bool(options.get("read_only")))
    if kind == "remote":
        _check_url(options["url"], f"{where}.url")
        if options.get("storage_options") is not None and not isinstance(options["storage_options"], Mapping):
            raise ConfigError(f"{where}.storage_options: expected a mapping")
        if options.get("compression") not in (None, "none", "zstd"):
            raise ConfigError(f"{where}.compression: {options['compression']!r} is not one of none | zstd")
    if kind == "disk" and options.get("codec", "none") not in ("none", "zstd"):
        raise ConfigError(f"{where}.codec: {options['codec']!r} is not one of none | zstd")
    name = entry.get("name", kind)
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}.name: expected a non-empty string")
    return TierConfig(kind=kind, name=name, options=options)


def _existing_ancestor(path: Path) -> Path:
    """``path`` itself if it exists, else its nearest existing parent (what a mkdir would write into)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _check_writable(path, key: str, read_only: bool) -> str:
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise ConfigError(f"{key}: expected a directory path, got {path!r}")
    p = Path(os.path.expanduser(str(path))).absolute()
    probe = _existing_ancestor(p)
    if probe.exists() and not probe.is_dir():
        raise ConfigError(f"{key}: {str(probe)!r} exists and is not a directory")
    if not read_only and not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: {str(p)!r} is not writable")
    if read_only and not p.is_dir():
        raise ConfigError(f"{key}: {str(p)!r} does not exist (read_only tiers open an existing directory)")
    return str(p)


def _check_url(url, key: str) -> None:
    import fsspec

    if not isinstance(url, str) or not url:
        raise ConfigError(f"{key}: expected an fsspec URL such as s3://bucket/prefix, got {url!r}")
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    if protocol not in fsspec.available_protocols():
        raise ConfigError(f"{key}: unknown URL scheme {protocol!r} in {url!r}")
    try:
        fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError) as exc:
        raise ConfigError(f"{key}: scheme {protocol!r} needs a package that is not installed: {exc}") from None
