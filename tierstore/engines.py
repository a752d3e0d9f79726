"""What the engine adapters (``adapters/vllm``, ``adapters/sglang``) share, engine-agnostic: per-rank
disk directories, opening a store without ever failing an engine's start, and the weight loaders'
options and tensor stream."""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from .config import read_config
from .errors import ConfigError, LockedError
from .store import open

if TYPE_CHECKING:
    from .store import TieredStore

log = logging.getLogger("tierstore")

#: the keys of an engine's ``model_loader_extra_config`` that belong to tierstore's weight loaders
LOADER_KEYS = ("uri", "storage_options", "store")


def rank_config(config: Mapping[str, Any], rank_dir: str, *, read_only: bool = False) -> dict[str, Any]:
    """``config`` with each disk tier in its own ``rank_dir`` subdirectory (an engine rank is a process,
    and a disk directory belongs to one process); ``read_only`` opens those directories without owning
    them (ranks reading what a writer rank stores), creating them first if needed."""
    out = copy.deepcopy(dict(config))
    for tier in out.get("tiers", []):
        if isinstance(tier, dict) and tier.get("kind") == "disk" and isinstance(tier.get("path"), str):
            path = Path(os.path.expanduser(tier["path"])) / rank_dir
            tier["path"] = str(path)
            if read_only:
                path.mkdir(mode=0o700, parents=True, exist_ok=True)
                tier["read_only"] = True
                tier.pop("instances", None)
    return out


def open_store(config: Mapping[str, Any]) -> TieredStore:
    """Open a rank's store; a disk directory locked by another process is skipped (logged) while the
    other tiers still serve: an engine never fails to start because of the cache."""
    # a server config gives a ServerStore, typed here as the TieredStore the adapters annotate (it has every
    # method they call; moving their annotations to tierstore.Store is theirs to do)
    try:
        return cast("TieredStore", open(dict(config)))
    except LockedError as exc:
        kept = [t for t in config.get("tiers", []) if not (isinstance(t, dict) and t.get("kind") == "disk")]
        if not kept:
            raise
        log.warning("tierstore: %s; running without the disk tier(s)", exc)
        return cast("TieredStore", open({**config, "tiers": kept}))


def split_loader_options(extra: Mapping[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(tierstore's options, the rest)`` of a ``model_loader_extra_config``, tierstore's checked."""
    rest = dict(extra or {})
    own = {k: rest.pop(k) for k in LOADER_KEYS if k in rest}
    if "uri" in own and not isinstance(own["uri"], str):
        raise ConfigError("model_loader_extra_config.uri must be a string")
    if not isinstance(own.get("storage_options", {}), dict):
        raise ConfigError("model_loader_extra_config.storage_options must be a dict")
    return own, rest


def iter_weights(uri: str, options: Mapping[str, Any], rank_dir: str | None) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's tensors through :func:`tierstore.weights.iter_tensors`, cached in the store that
    ``options["store"]`` configures (its disk tiers in ``rank_dir`` when given), closed at the end."""
    from . import weights

    store = None
    if options.get("store") is not None:
        config = read_config(options["store"])
        store = open_store(rank_config(config, rank_dir) if rank_dir else config)
    try:
        yield from weights.iter_tensors(uri, device="cpu", store=store, storage_options=options.get("storage_options"))
    finally:
        if store is not None:
            store.close()
