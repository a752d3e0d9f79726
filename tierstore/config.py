"""Store configuration: parsing and validating the user's dict / YAML / JSON before anything is built.

Every mistake raises :class:`ConfigError` naming the offending key (``tiers[1].capacity``), and nothing is
written to storage until the whole configuration has been checked.
"""

from __future__ import annotations

import enum
import json
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from .backends.layout import PERMISSIONS
from .errors import ConfigError
from .residency import Pressure
from .sizes import format_size, parse_seconds, parse_size
from .urls import check_storage_options, check_url

E = TypeVar("E", bound=enum.Enum)
ENV_CONFIG = "TIERSTORE_CONFIG"
DEFAULT_ROOT = "~/.cache/tierstore"


class WritePolicy(str, enum.Enum):
    WRITE_BACK = "write_back"
    WRITE_THROUGH = "write_through"


class PrefetchPolicy(str, enum.Enum):
    RETAIN = "retain"
    TRANSIENT = "transient"


_STORE_KEYS = {"tiers", "write_policy", "prefetch_policy", "max_in_flight", "close_timeout", "on_pressure", "metrics"}
#: how many directories (``disk``, ``disk.1`` …) the default disk tier may take: one per process on a host
DEFAULT_DISK_INSTANCES = 8


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
    close_timeout: float = 10.0  # seconds close() (and the flush at exit) waits for write-back with no progress
    on_pressure: Pressure = Pressure.DROP
    metrics: MetricsConfig | None = None  # serve Prometheus /metrics


@dataclass(frozen=True)
class MetricsConfig:
    """``metrics: {port: 9400, host: 127.0.0.1}``: where the store serves ``/metrics`` (port 0: any free one)."""

    port: int
    host: str = "127.0.0.1"


def _metrics(value: Any) -> MetricsConfig | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ConfigError(f"metrics: expected a mapping like {{port: 9400}}, got {type(value).__name__}")
    unknown = set(value) - {"port", "host"}
    if unknown:
        raise ConfigError(f"metrics: unknown key(s): {', '.join(sorted(unknown))}")
    port = value.get("port")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ConfigError(f"metrics.port: expected a TCP port (0-65535), got {port!r}")
    host = value.get("host", "127.0.0.1")
    if not isinstance(host, str) or not host:
        raise ConfigError(f"metrics.host: expected a host name or address, got {host!r}")
    return MetricsConfig(port, host)


def default_config(root: str = DEFAULT_ROOT) -> dict[str, Any]:
    """The embedded default: a host tier and a disk tier under ``root``, sized from free RAM and disk.

    Several processes on one host can each open it: the disk tier takes the first of ``disk``, ``disk.1``
    … ``disk.7`` no other process holds (a restarted process usually finds its own directory free again).
    """
    path = Path(os.path.expanduser(root))
    try:
        avail_ram = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        avail_ram = 4 << 30
    free_disk = shutil.disk_usage(_existing_ancestor(path)).free
    return {
        "tiers": [
            {"kind": "host", "capacity": max(64 << 20, min(avail_ram // 4, 8 << 30))},
            {"kind": "disk", "path": str(path / "disk"), "capacity": max(256 << 20, min(free_disk // 2, 64 << 30)),
             "instances": DEFAULT_DISK_INSTANCES},
        ],
        "write_policy": "write_back",
        "prefetch_policy": "retain",
    }


def read_config(config: Mapping[str, Any] | str | os.PathLike[str] | None) -> dict[str, Any]:
    """Turn ``None`` (``$TIERSTORE_CONFIG`` or the default), a path or a mapping into a plain dict."""
    origin = ""
    if config is None:
        config = os.environ.get(ENV_CONFIG) or None
        if config is None:
            return default_config()
        origin = f" (from ${ENV_CONFIG})"
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        path = Path(config).expanduser()
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigError(f"config file {str(path)!r}{origin} cannot be read: {exc.strerror or exc}") from None
        try:
            if path.suffix.lower() == ".json":
                data = json.loads(text)
            else:
                import yaml
                data = yaml.safe_load(text)
        except Exception as exc:  # yaml and json raise different types; both mean a bad file
            raise ConfigError(f"config file {str(path)!r}{origin} is not valid YAML/JSON: {_where_in(exc)}") from None
        if not isinstance(data, Mapping):
            raise ConfigError(f"config file {str(path)!r}{origin} must hold a mapping at the top level")
        return dict(data)
    raise ConfigError(f"config must be a mapping, a file path or None, got {type(config).__name__}")


def _where_in(exc: Exception) -> str:
    """A YAML or JSON error as ``line L, column C: problem`` (yaml's own text names "<unicode string>")."""
    mark = getattr(exc, "problem_mark", None)
    if mark is not None:
        return f"line {mark.line + 1}, column {mark.column + 1}: {getattr(exc, 'problem', None) or exc}"
    if isinstance(exc, json.JSONDecodeError):
        return f"line {exc.lineno}, column {exc.colno}: {exc.msg}"
    return " ".join(str(exc).split())


def parse_config(config: Mapping[str, Any] | str | os.PathLike[str] | None = None) -> StoreConfig:
    """Validate a configuration and return it as a :class:`StoreConfig`."""
    raw = read_config(config)
    unknown = set(raw) - _STORE_KEYS
    if unknown:
        raise ConfigError(f"unknown config key(s): {', '.join(sorted(unknown))}")
    tiers_raw = raw.get("tiers")
    if not isinstance(tiers_raw, list) or not tiers_raw:
        raise ConfigError("tiers: expected a non-empty list of tier entries")
    tiers: list[TierConfig] = []
    names: set[str] = set()
    for i, entry in enumerate(tiers_raw):
        tier = _parse_tier(entry, f"tiers[{i}]")
        if tier.name in names:
            raise ConfigError(f"tiers[{i}].name: duplicate tier name {tier.name!r} (give each a name:)")
        names.add(tier.name)
        _check_order(tiers, tier, i)
        tiers.append(tier)
    return StoreConfig(
        tiers=tuple(tiers),
        write_policy=_enum(WritePolicy, raw.get("write_policy", "write_back"), "write_policy"),
        prefetch_policy=_enum(PrefetchPolicy, raw.get("prefetch_policy", "retain"), "prefetch_policy"),
        max_in_flight=_positive_int(raw.get("max_in_flight", 8), "max_in_flight"),
        close_timeout=_seconds(raw.get("close_timeout", 10.0), "close_timeout"),
        on_pressure=_enum(Pressure, raw.get("on_pressure", "drop"), "on_pressure"),
        metrics=_metrics(raw.get("metrics")),
    )


def _enum(cls: type[E], value: Any, key: str) -> E:
    try:
        return cls(value)
    except ValueError:
        allowed = " | ".join(m.value for m in cls)
        raise ConfigError(f"{key}: {value!r} is not one of {allowed}") from None


def _positive_int(value: Any, key: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{key}: expected a positive integer, got {value!r}")
    return value


# ---------------------------------------------------------------------- tier options, checked in one place
def _bool(value: Any, key: str) -> bool:
    if not isinstance(value, bool):  # "false" is truthy: a quoted YAML boolean must not flip a mode
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    return value


def _optional_bool(value: Any, key: str) -> bool | None:
    return None if value is None else _bool(value, key)


def _capacity(value: Any, key: str) -> int | None:
    if value is None:
        return None
    size = parse_size(value, key=key)
    if size == 0:  # every put would be refused: a tier that can hold nothing is a mistake, not a mode
        raise ConfigError(f"{key}: a capacity of 0 holds nothing; give a size such as '512MiB', or remove the tier")
    return size


def _device(value: Any, key: str) -> str:
    from .errors import InvalidInputError
    from .tensors import check_device

    if not isinstance(value, str):
        raise ConfigError(f"{key}: expected a torch device such as 'cuda:0', got {value!r}")
    try:
        return str(check_device(value))
    except InvalidInputError as exc:
        raise ConfigError(f"{key}: {exc}") from None


def _host_capacity(value: Any, key: str) -> int | None:
    size = _capacity(value, key)
    ram = physical_memory()
    if size is not None and ram is not None and size > ram:
        raise ConfigError(f"{key}: {format_size(size)} is more than this host's {format_size(ram)} of RAM")
    return size


def _slot_size(value: Any, key: str) -> int:
    size = parse_size(value, key=key)
    if size <= 0 or size % 64:
        raise ConfigError(f"{key}: expected a positive multiple of 64 bytes, got {value!r}")
    return size


def _shared_memory(value: Any, key: str) -> bool | str:
    return value if value == "writable" else _bool(value, key)


def _one_of(*allowed: Any) -> Callable[[Any, str], Any]:
    def check(value: Any, key: str) -> Any:
        if value not in allowed:
            raise ConfigError(f"{key}: {value!r} is not one of {' | '.join(str(a) for a in allowed)}")
        return value
    return check


def _mapping(value: Any, key: str) -> Mapping[str, Any] | None:
    if value is not None and not isinstance(value, Mapping):
        raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__}")
    return value


def _path(value: Any, key: str) -> str:
    if not isinstance(value, (str, os.PathLike)) or not str(value):
        raise ConfigError(f"{key}: expected a directory path, got {value!r}")
    if "\0" in str(value):
        raise ConfigError(f"{key}: the path contains a NUL character: {str(value)!r}")
    return os.path.abspath(os.path.expanduser(os.fspath(value)))


def _url(value: Any, key: str) -> str:
    return check_url(value, key)


def _storage_options(value: Any, key: str) -> Mapping[str, Any] | None:
    return _mapping(value, key)  # its keys are checked against the url's filesystem in check_tier_options


def _seconds(value: Any, key: str) -> float:
    return parse_seconds(value, key=key)


def _optional_seconds(value: Any, key: str) -> float | None:
    return None if value is None else _seconds(value, key)


#: why a remote tier takes no ``capacity``
REMOTE_CAPACITY_REFUSED = (
    "a remote tier has no capacity: its prefix is shared, and a per-process LRU would delete other writers' "
    "fresh objects. Keep it within a budget with `tierstore gc --max-size SIZE` (least recently used first, from "
    "listings only; `--watch` keeps it there), or bucket lifecycle rules (S3/GCS expiration)")


def _no_capacity(value: Any, key: str) -> None:
    if value is not None:
        raise ConfigError(f"{key}: {REMOTE_CAPACITY_REFUSED}")


def _auth(value: Any, key: str) -> Mapping[str, Any] | None:
    if value is None:
        return None
    from .keyring import Keyring  # the check reads the keys: a missing or unsafe key file fails at parse time

    Keyring.from_options(value, key)
    return dict(value)


_PERMISSIONS = _one_of(*PERMISSIONS)
#: every option of every tier kind, with the check that validates (and normalises) its value
TIER_OPTIONS: dict[str, dict[str, Callable[[Any, str], Any]]] = {
    "device": {"device": _device, "capacity": _capacity},
    "host": {"capacity": _host_capacity, "pinned": _bool, "pool": _optional_bool, "slot_size": _slot_size,
             "shared_memory": _shared_memory},
    "disk": {"path": _path, "capacity": _capacity, "durable": _bool, "read_only": _bool,
             "compression": _one_of(None, "none", "zstd"), "codec": _one_of("none", "zstd"),
             "io_threads": _positive_int, "permissions": _PERMISSIONS,
             "instances": _positive_int, "verify_reads": _one_of("always", "once")},
    "remote": {"url": _url, "storage_options": _storage_options, "compression": _one_of(None, "none", "zstd"),
               "capacity": _no_capacity, "max_in_flight": _positive_int, "list_on_open": _bool,
               "timeout": _seconds, "permissions": _PERMISSIONS, "touch_after": _optional_seconds, "auth": _auth,
               "verify_reads": _one_of("always", "once")},
}
_REQUIRED = {"disk": {"path"}, "remote": {"url"}}


def check_tier_options(kind: str, options: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Validate the options given for a ``kind`` tier; return them normalised (sizes in bytes, paths
    absolute). Raises :class:`ConfigError` naming ``<where>.<key>``. Tier constructors call this too, so
    a tier built directly is checked exactly like one from a config file."""
    checks = TIER_OPTIONS[kind]
    unknown = set(options) - set(checks)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) for a {kind} tier: {', '.join(sorted(unknown))}")
    out = {key: checks[key](value, f"{where}.{key}") for key, value in options.items()}
    if kind == "disk" and "compression" in out:  # one name for both tiers; `codec` stays as an alias
        if "codec" in out:
            raise ConfigError(f"{where}: give compression (or its old name codec), not both")
        out["codec"] = out.pop("compression") or "none"
    if kind == "remote" and out.get("url") and out.get("storage_options") is not None:
        check_storage_options(out["url"], dict(out["storage_options"]), f"{where}.storage_options")
    if kind == "disk":
        _check_writable(out["path"], f"{where}.path", read_only=out.get("read_only", False))
    return out


def physical_memory() -> int | None:
    """Bytes of RAM on this host (``None`` where the platform does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def _parse_tier(entry: Any, where: str) -> TierConfig:
    if not isinstance(entry, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {type(entry).__name__}")
    kind = entry.get("kind")
    options = {k: v for k, v in entry.items() if k not in ("kind", "name")}
    if kind in TIER_OPTIONS:
        missing = _REQUIRED.get(kind, set()) - set(options)
        if missing:
            raise ConfigError(f"{where}: a {kind} tier needs {', '.join(sorted(missing))}")
        options = check_tier_options(kind, options, where)
    else:  # a registered third-party backend checks its own options; capacity is the store's
        from .backends import backend_class, known_kinds

        if not isinstance(kind, str) or kind not in known_kinds():
            raise ConfigError(f"{where}.kind: unknown tier kind {kind!r} (one of {', '.join(known_kinds())})")
        capacity = _capacity(options.pop("capacity", None), f"{where}.capacity")
        options = backend_class(kind).check_options(options, where)
        if capacity is not None:
            options["capacity"] = capacity
    name = entry.get("name", kind)
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}.name: expected a non-empty string")
    return TierConfig(kind=kind, name=name, options=options)


#: the built-in kinds, fastest first: a config lists its tiers in this order
SPEED_ORDER = ("device", "host", "disk", "remote")


def _speed_rank(tier: TierConfig) -> int:
    if tier.kind == "device" and tier.options.get("device") == "cpu":
        return SPEED_ORDER.index("host")  # a device tier on the CPU is host memory
    return SPEED_ORDER.index(tier.kind)


def _check_order(above: list[TierConfig], tier: TierConfig, i: int) -> None:
    """Tiers are listed fastest first; a built-in kind below a slower one (disk above host) would promote
    chunks downward. Third-party kinds and ``read_only`` tiers (never written: their place only orders
    lookups) may sit anywhere."""
    if tier.kind not in SPEED_ORDER or tier.options.get("read_only"):
        return
    for j, prev in enumerate(above):
        if prev.kind in SPEED_ORDER and not prev.options.get("read_only") and _speed_rank(prev) > _speed_rank(tier):
            raise ConfigError(f"tiers[{i}]: a {tier.kind} tier below the {prev.kind} tier tiers[{j}]; list tiers "
                              f"fastest first ({' > '.join(SPEED_ORDER)})")


def _existing_ancestor(path: Path) -> Path:
    """``path`` itself if it exists, else its nearest existing parent (what a mkdir would write into)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _check_writable(path: str, key: str, read_only: bool) -> None:
    p = Path(path)
    probe = _existing_ancestor(p)
    if probe.exists() and not probe.is_dir():
        raise ConfigError(f"{key}: {str(probe)!r} exists and is not a directory")
    if not read_only and not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: {str(p)!r} is not writable")
    if read_only and not p.is_dir():
        raise ConfigError(f"{key}: {str(p)!r} does not exist (read_only tiers open an existing directory)")

