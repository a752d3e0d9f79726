"""Store operations as a bench times them: one batched call where the store has it (``put_many``,
``get_many``), the per-key loop otherwise, so a bench measures whichever data path the store offers."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..keys import ChunkKey

Items = Sequence[tuple[ChunkKey, Mapping[str, torch.Tensor]]]


def batched(store: Any) -> bool:
    """Whether ``store`` has the batched API."""
    return hasattr(store, "get_many") and hasattr(store, "put_many")


def put_all(store: Any, items: Items) -> None:
    """Store every item and wait until the writes are done."""
    if hasattr(store, "put_many"):
        store.put_many(items)
    else:
        for k, v in items:
            store.put(k, v)
    store.flush()


def get_all_into(store: Any, keys: Sequence[ChunkKey], outs: Sequence[Mapping[str, torch.Tensor]]) -> list[Any]:
    """Read each key into its caller-owned ``outs`` entry; per-key results (``None`` = miss)."""
    if hasattr(store, "get_many"):
        return list(store.get_many(keys, out=outs))
    return [store.get(k, out=o) for k, o in zip(keys, outs, strict=True)]


def delete_all(store: Any, keys: Sequence[ChunkKey]) -> None:
    """Remove ``keys`` from every tier of ``store`` (``store.delete``: its index and its storage alike)."""
    store.delete(list(keys))


def wait_for_jobs(store: Any, kinds: Sequence[str] = ("promote", "prefetch"), timeout: float = 60.0) -> None:
    """Wait until ``store`` runs no transfer job of ``kinds`` (``stats()["jobs"]``): promotions run in the
    background after the read that admitted them returns. Raises ``TimeoutError`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while any(j["kind"] in kinds for j in store.stats()["jobs"]["running"]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{', '.join(kinds)} jobs still running after {timeout:g} s")
        time.sleep(0.002)
