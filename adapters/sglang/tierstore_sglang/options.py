"""The backend's options (``--hicache-storage-backend-extra-config``) and the store each rank opens."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tierstore.config import DEFAULT_ROOT, default_config, read_config
from tierstore.errors import ConfigError

log = logging.getLogger("tierstore_sglang")

#: keys of the extra config this backend reads
OPTION_KEYS = frozenset({"config", "remote", "storage_options", "model_id", "revision", "tenant"})
#: keys SGLang itself reads from the same dict (the dynamic factory's and the controller's)
SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size"})


@dataclass(frozen=True)
class BackendOptions:
    """Parsed extra config.

    Attributes
    ----------
    config:
        The tierstore config as a dict (``"config"``: a dict or a YAML/JSON path). Default: one disk tier
        under ``~/.cache/tierstore/sglang`` (SGLang's host pool is the host tier) plus, with ``"remote"``
        (an fsspec URL such as ``s3://bucket/kv`` or ``file:///mnt/nfs/kv``, options in
        ``"storage_options"``), a remote tier that instances share.
    model_id, revision:
        What names the model in the keys; default SGLang's model name and ``""``. Set ``model_id`` when
        instances serve the same weights under different paths.
    tenant:
        A salt isolating this deployment's cache (``None`` = shared).
    """

    config: dict[str, Any]
    model_id: str | None = None
    revision: str = ""
    tenant: str | None = None

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None) -> BackendOptions:
        """Validate ``extra``; raises :class:`tierstore.ConfigError` (a ``ValueError``) on bad input."""
        extra = dict(extra or {})
        unknown = set(extra) - OPTION_KEYS - SGLANG_KEYS
        if unknown:
            log.warning("tierstore: ignoring unknown extra config key(s) %s (known: %s)", sorted(unknown),
                        sorted(OPTION_KEYS))
        for name in ("model_id", "revision", "tenant", "remote"):
            if extra.get(name) is not None and not (isinstance(extra[name], str) and extra[name]):
                raise ConfigError(f"hicache extra config: {name} must be a non-empty string")
        if extra.get("storage_options") is not None and not isinstance(extra["storage_options"], Mapping):
            raise ConfigError("hicache extra config: storage_options must be a mapping")
        if extra.get("config") is not None:
            if extra.get("remote") is not None:
                raise ConfigError("hicache extra config: give either config (a whole tierstore config) or "
                                  "remote (added to the default one), not both")
            config = read_config(extra["config"])
        else:
            config = default_backend_config(extra.get("remote"), extra.get("storage_options"))
        return cls(config=config, model_id=extra.get("model_id"), revision=extra.get("revision") or "",
                   tenant=extra.get("tenant"))


def default_backend_config(remote: str | None = None,
                           storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A disk tier under ``~/.cache/tierstore/sglang`` (sized like tierstore's default) and, with
    ``remote``, a remote tier below it."""
    disk = next(t for t in default_config(os.path.join(DEFAULT_ROOT, "sglang"))["tiers"] if t["kind"] == "disk")
    tiers: list[dict[str, Any]] = [disk]
    if remote is not None:
        entry: dict[str, Any] = {"kind": "remote", "url": remote}
        if storage_options:
            entry["storage_options"] = dict(storage_options)
        tiers.append(entry)
    return {"tiers": tiers, "write_policy": "write_back", "prefetch_policy": "retain"}
