"""The options of ``TierstoreTier`` (one entry of ``"secondary_tiers"``), checked at engine start-up."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tierstore.config import ENV_CONFIG, read_config
from tierstore.errors import ConfigError

#: what a tier entry may hold besides vLLM's own keys (``type``, ``module_path`` and ``backpressure`` are
#: taken by vLLM's factory before the tier sees its options; ``locality`` is vLLM's and ours)
OPTION_KEYS = ("config", "server", "model_id", "revision", "tenant", "locality", "enable_kv_events", "io_threads")

#: tier kinds a secondary tier can keep chunks in (a ``device`` tier alone holds nothing for vLLM's CPU tier)
STORAGE_KINDS = ("host", "disk", "remote")

_WHERE = "secondary_tiers[TierstoreTier]"


@dataclass(frozen=True)
class TierOptions:
    """Parsed options of one ``TierstoreTier`` entry.

    Attributes
    ----------
    config:
        The tierstore config: ``"config"`` (a dict or a YAML/JSON path; default ``$TIERSTORE_CONFIG``), or
        ``{"server": url}`` from ``"server": "unix:///..."`` (a node's ``tierstore serve``).
    model_id, revision:
        What names the model in the keys (default: vLLM's model path and revision); set ``model_id`` when
        instances load the same weights from different paths.
    tenant:
        A salt of this deployment's keys: engines with different tenants never share (vLLM's own
        ``cache_salt`` is already in its block hashes, per request).
    locality:
        ``"LOCAL"`` or ``"REMOTE"`` (vLLM's KV events and load filters); default: ``REMOTE`` when the config
        has a shared tier or names a node server, else ``LOCAL``.
    enable_kv_events:
        Emit ``BlockStored`` events (medium ``STORAGE``) for chunks this tier stored, when vLLM's KV events
        are on.
    io_threads:
        Threads copying chunks between vLLM's CPU tier and the store, for loads and for stores each.
    """

    config: dict[str, Any]
    model_id: str | None = None
    revision: str | None = None
    tenant: str | None = None
    locality: str | None = None
    enable_kv_events: bool = False
    io_threads: int = 4

    @classmethod
    def parse(cls, options: Mapping[str, Any]) -> TierOptions:
        """Validate ``options``; raises :class:`tierstore.ConfigError` (a ``ValueError``) naming the key."""
        unknown = sorted(set(options) - set(OPTION_KEYS))
        if unknown:
            raise ConfigError(f"{_WHERE}: unknown option(s) {unknown}; known: {list(OPTION_KEYS)}")
        config = _store_config(options)
        for name in ("model_id", "revision", "tenant"):
            value = options.get(name)
            if value is not None and (not isinstance(value, str) or (name != "revision" and not value)):
                raise ConfigError(f"{_WHERE}.{name} must be a non-empty string, got {value!r}")
        locality = options.get("locality")
        if locality is not None and locality not in ("LOCAL", "REMOTE"):
            raise ConfigError(f"{_WHERE}.locality must be 'LOCAL' or 'REMOTE', got {locality!r}")
        events = options.get("enable_kv_events", False)
        if not isinstance(events, bool):
            raise ConfigError(f"{_WHERE}.enable_kv_events must be true or false, got {events!r}")
        threads = options.get("io_threads", cls.io_threads)
        if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 64:
            raise ConfigError(f"{_WHERE}.io_threads must be an int in [1, 64], got {threads!r}")
        if locality is None:
            shared = "server" in config or any(t.get("kind") == "remote" for t in config["tiers"])
            locality = "REMOTE" if shared else "LOCAL"
        return cls(config=config, model_id=options.get("model_id"), revision=options.get("revision"),
                   tenant=options.get("tenant"), locality=locality, enable_kv_events=events, io_threads=threads)

    @property
    def through_server(self) -> bool:
        return "server" in self.config


def _store_config(options: Mapping[str, Any]) -> dict[str, Any]:
    """The tierstore config the options name: ``server`` or ``config`` (or ``$TIERSTORE_CONFIG``), with at
    least one host, disk or remote tier."""
    if "server" in options:
        if "config" in options:
            raise ConfigError(f"{_WHERE}: give 'config' or 'server', not both")
        url = options["server"]
        if not isinstance(url, str) or not url.startswith("unix://"):
            raise ConfigError(f"{_WHERE}.server must be a 'unix:///path/to/tierstore.sock' URL, got {url!r}")
        return {"server": url}
    if options.get("config") is None and not os.environ.get(ENV_CONFIG):
        raise ConfigError(f"{_WHERE}: needs 'config' (a tierstore config dict or a YAML/JSON path; or "
                          f"${ENV_CONFIG}) or 'server' (a node server's unix:// URL)")
    config = read_config(options.get("config"))
    if "server" in config:
        return config
    tiers = config.get("tiers")
    if not isinstance(tiers, list) or not any(isinstance(t, Mapping) and t.get("kind") in STORAGE_KINDS
                                              for t in tiers):
        raise ConfigError(f"{_WHERE}.config: 'tiers' names no local (host, disk) or shared (remote) tier, got "
                          f"{tiers!r}")
    return config
