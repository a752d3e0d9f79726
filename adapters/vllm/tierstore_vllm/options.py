"""The connector's options (``kv_connector_extra_config``) and the store each worker opens."""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierstore import engines
from tierstore.config import read_config
from tierstore.errors import ConfigError
from tierstore.sizes import parse_size

from .lookup import private_dir

log = logging.getLogger("tierstore_vllm")

#: Keys of ``kv_connector_extra_config`` the connector understands.
OPTION_KEYS = {"config", "chunk_tokens", "model_id", "revision", "lookup_timeout_s", "remote_wait_s",
               "socket_dir", "load_failure_policy", "save_memory", "layerwise"}


@dataclass(frozen=True)
class ConnectorOptions:
    """Parsed ``kv_connector_extra_config``.

    Attributes
    ----------
    config:
        The tierstore config as a dict (``"config"``: a dict or a YAML/JSON path; default: the embedded
        default, or ``$TIERSTORE_CONFIG``).
    chunk_tokens:
        Tokens per stored chunk; ``None`` = the smallest multiple of vLLM's block size that is >= 256.
    model_id, revision:
        What names the model in the KV keys; default vLLM's ``served_model_name`` and ``revision``. Set
        ``model_id`` when instances load the same weights from different local paths under different names.
    lookup_timeout_s:
        How long ``get_num_new_matched_tokens`` waits for the workers' answer before it returns ``None``
        ("ask again next step"); it never waits longer.
    remote_wait_s:
        How long a request may be held back (``None``) while the workers promote its chunks from a
        remote tier; past that it is scheduled with what is local.
    socket_dir:
        Directory of the scheduler-to-worker lookup sockets (default: a private dir under $TMPDIR).
    load_failure_policy:
        ``"recompute"`` (default): a chunk that vanished between lookup and load is recomputed, so the
        connector sets vLLM's ``kv_load_failure_policy`` to it; ``"fail"`` keeps vLLM's setting.
    save_memory:
        Bytes (or a size string) of KV a worker may hold copied out of the paged cache while its writes to
        the store are queued (default 1 GiB); a save that would go over is dropped and counted
        (``saves_dropped``), a prompt larger than the budget is saved when nothing else is queued. A store
        that saves in place (a host pool on top, ``write_back``) queues no copies: this bound is for the others.
    layerwise:
        ``true`` (default): layer ``i`` of a loaded prefix is usable as soon as it has arrived, so the forward
        of early layers overlaps the load of later ones; ``false``: ``start_load_kv`` waits for the whole
        prefix before the forward starts (to measure the difference, or where a backend gains nothing).
    """

    config: dict[str, Any]
    chunk_tokens: int | None = None
    model_id: str | None = None
    revision: str | None = None
    lookup_timeout_s: float = 0.02
    remote_wait_s: float = 5.0
    socket_dir: str | None = None
    load_failure_policy: str = "recompute"
    save_memory: int = 1 << 30
    layerwise: bool = True

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None) -> ConnectorOptions:
        """Validate ``extra``; raises :class:`tierstore.ConfigError` (a ``ValueError``) on bad input."""
        extra = dict(extra or {})
        unknown = set(extra) - OPTION_KEYS
        if unknown:
            raise ConfigError(f"kv_connector_extra_config: unknown key(s) {sorted(unknown)}; "
                              f"known: {sorted(OPTION_KEYS)}")
        config = read_config(extra.get("config"))
        chunk = extra.get("chunk_tokens")
        if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1):
            raise ConfigError(f"kv_connector_extra_config.chunk_tokens must be a positive int, got {chunk!r}")
        for name in ("lookup_timeout_s", "remote_wait_s"):
            value = extra.get(name, getattr(cls, name))
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"kv_connector_extra_config.{name} must be a number >= 0, got {value!r}")
        for name in ("model_id", "revision", "socket_dir"):
            if extra.get(name) is not None and not isinstance(extra[name], str):
                raise ConfigError(f"kv_connector_extra_config.{name} must be a string")
        policy = extra.get("load_failure_policy", "recompute")
        if policy not in ("recompute", "fail"):
            raise ConfigError(f"kv_connector_extra_config.load_failure_policy must be 'recompute' or 'fail', "
                              f"got {policy!r}")
        save_memory = parse_size(extra.get("save_memory", cls.save_memory), key="kv_connector_extra_config.save_memory")
        if save_memory < 1:
            raise ConfigError("kv_connector_extra_config.save_memory must be positive")
        layerwise = extra.get("layerwise", cls.layerwise)
        if not isinstance(layerwise, bool):
            raise ConfigError(f"kv_connector_extra_config.layerwise must be true or false, got {layerwise!r}")
        return cls(config=config, load_failure_policy=policy, chunk_tokens=chunk, model_id=extra.get("model_id"),
                   save_memory=save_memory, layerwise=layerwise,
                   revision=extra.get("revision"),
                   lookup_timeout_s=float(extra.get("lookup_timeout_s", cls.lookup_timeout_s)),
                   remote_wait_s=float(extra.get("remote_wait_s", cls.remote_wait_s)),
                   socket_dir=extra.get("socket_dir"))

    @property
    def through_server(self) -> bool:
        """The config names a node server (``{"server": "unix:///..."}``): every rank and the scheduler use it,
        and the scheduler asks it directly instead of the ranks' lookup sockets."""
        return "server" in self.config

    def chunk_size(self, block_size: int) -> int:
        """Tokens per chunk for vLLM blocks of ``block_size``: a whole number of blocks, so every hit and
        every load is block-aligned."""
        if self.chunk_tokens is not None:
            if self.chunk_tokens % block_size:
                raise ConfigError(f"chunk_tokens={self.chunk_tokens} is not a multiple of vLLM's "
                                  f"block_size={block_size}")
            return self.chunk_tokens
        return block_size * max(1, -(-256 // block_size))


def socket_path(socket_dir: str | None, engine_id: str, tp_rank: int, pp_rank: int) -> str:
    """Path of the lookup socket of one worker rank of one engine (short enough for AF_UNIX)."""
    base = private_dir(Path(socket_dir) if socket_dir
                       else Path(tempfile.gettempdir()) / f"tierstore-vllm-{os.getuid()}")
    tag = hashlib.blake2b(engine_id.encode(), digest_size=8).hexdigest()
    return str(base / f"{tag}-tp{tp_rank}-pp{pp_rank}.sock")


def rank_config(config: Mapping[str, Any], tp_rank: int, tp_size: int, pp_rank: int,
                pp_size: int) -> dict[str, Any]:
    """``config`` with each disk tier's path given a per-rank subdirectory when there are several ranks,
    so the workers of one engine never contend for one directory's lock."""
    return engines.rank_config(config, f"tp{tp_rank}-pp{pp_rank}") if tp_size * pp_size > 1 else dict(config)
