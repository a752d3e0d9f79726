"""Publish a checkpoint in a store-friendly, content-addressed layout.

``publish(src, dst)`` streams ``src`` (anything :func:`iter_tensors` reads) and writes::

    dst/model.safetensors.index.json        HF-style index, metadata.format = "tierstore-cas/1"
    <objects>/blake3-<hex>.safetensors      one valid safetensors file per tensor group

Large tensors get an object each; small ones (norms, biases) are grouped per layer. An object is named
by the BLAKE3 digest of its bytes — checked by every load (:mod:`.digest`) — so an object that already
exists (and still matches its name) is not written again: fine-tunes that share base layers, published
to the same ``objects_url``, share those objects — and so their cached chunks in a store too (the range
cache keys a file's bytes by the file's identity). Any safetensors reader can read each object;
:func:`tierstore.weights.load` reads ``dst`` back bit-exactly.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import torch

from ..backends.layout import PUBLISH_PREFIX
from ..errors import InvalidInputError
from ..tensors import byte_view
from .checkpoint import CAS_LAYOUT, INDEX_SUFFIX, open_checkpoint
from .digest import object_name
from .header import build_header
from .loader import iter_tensors
from .sources import filesystem, is_local, local_path

SMALL_TENSOR = 1024 * 1024
_HASH_BLOCK = 8 * 1024 * 1024
#: seconds after which a publish's temp file is taken for a killed publish's and removed
STALE_TEMP_S = 3600.0
_LAYER = re.compile(r"^(.*?\.\d+)\.")


def object_group(name: str, nbytes: int) -> str:
    """The object a tensor goes to: itself when large, its layer (``model.layers.7``) when small."""
    if nbytes >= SMALL_TENSOR:
        return name
    m = _LAYER.match(name)
    return "small:" + (m.group(1) if m else name.rpartition(".")[0])


class _Target:
    def __init__(self, url: str, storage_options: dict[str, Any] | None):
        self.local = is_local(url)
        self.fs: Any  # an fsspec filesystem; None for local paths
        if self.local:
            self.fs, self.path = None, os.path.abspath(local_path(url))
        else:
            self.fs, self.path = filesystem(url, storage_options, 16)

    def join(self, *parts: str) -> str:
        return os.path.join(self.path, *parts) if self.local else posixpath.join(self.path, *parts)

    def intact(self, path: str, name: str) -> bool:
        """Whether ``path`` exists and its bytes still hash to ``name`` (its digest): an object changed
        in place is published again rather than kept."""
        try:
            with (open(path, "rb") if self.local else self.fs.open(path, "rb")) as f:
                return object_name(iter(lambda: f.read(_HASH_BLOCK), b"")) == name
        except FileNotFoundError:
            return False

    def remove_stale_temp(self, folder: str) -> int:
        """Remove the temp files killed publishes left in ``folder`` (local targets: a remote object is one
        PUT), once older than an hour (a publish beside this one may be writing its own)."""
        if not self.local:
            return 0
        removed = 0
        try:
            entries = list(os.scandir(folder))
        except FileNotFoundError:
            return 0
        for e in entries:
            try:
                if (e.name.startswith(PUBLISH_PREFIX) and e.is_file(follow_symlinks=False)
                        and time.time() - e.stat(follow_symlinks=False).st_mtime > STALE_TEMP_S):
                    os.unlink(e.path)
                    removed += 1
            except FileNotFoundError:
                pass
        return removed

    def write(self, path: str, chunks: list[bytes | memoryview]) -> None:
        """Publish ``path`` whole or not at all (temp + rename locally, one PUT remotely)."""
        if not self.local:
            self.fs.pipe_file(path, b"".join(bytes(c) for c in chunks))
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=PUBLISH_PREFIX)
        try:
            with os.fdopen(fd, "wb") as f:
                for c in chunks:
                    f.write(c)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise


def _object(tensors: list[tuple[str, torch.Tensor]]) -> tuple[str, list[bytes | memoryview]]:
    tensors = sorted(tensors)
    header = build_header([(n, t.dtype, tuple(t.shape), t.numel() * t.element_size()) for n, t in tensors])
    chunks = [header] + [byte_view(t).numpy().data for _, t in tensors if t.numel()]
    return object_name(chunks), chunks


def publish(src: str | os.PathLike[str], dst_url: str, *, storage_options: dict[str, Any] | None = None,
            dst_storage_options: dict[str, Any] | None = None, objects_url: str | None = None,
            src_objects_url: str | Sequence[str] | None = None, **opts: Any) -> dict[str, Any]:
    """Copy checkpoint ``src`` to ``dst_url`` in the content-addressed layout above.

    Args:
        src: a checkpoint as accepted by :func:`tierstore.weights.load`.
        dst_url: the directory (local or fsspec URL) that receives the index.
        storage_options / dst_storage_options: fsspec options for ``src`` / ``dst_url`` and ``objects_url``.
        objects_url: where objects go (default ``dst_url/objects``); share it between checkpoints to
            store their identical tensor groups once. Must be on the same filesystem as ``dst_url``.
        src_objects_url: where ``src``'s index may name shards besides its own directory, when ``src`` is
            itself a published checkpoint (the ``objects_url`` it was published with).
        **opts: loader options for reading ``src`` (``concurrency``, ``block_size``, ``memory_limit``,
            ``progress``: called as ``progress(bytes_done, bytes_total)`` as ``src`` is read; each group
            is written as soon as it is read).

    Returns:
        ``{"tensors", "objects", "objects_written", "objects_reused", "bytes_written", "stale_temp_removed",
        "index"}``. An object already in place is reused only when its bytes still match its name.
    """
    dst = _Target(dst_url, dst_storage_options)
    objs = _Target(objects_url, dst_storage_options) if objects_url else None
    if objs is not None and (objs.local != dst.local or (
            not dst.local and objs.fs.protocol != dst.fs.protocol)):
        raise InvalidInputError(f"objects_url {objects_url!r} must be on the same filesystem as {dst_url!r}")
    objects_dir = objs.path if objs else dst.join("objects")
    rel = (os.path.relpath if dst.local else posixpath.relpath)(objects_dir, dst.path)

    with open_checkpoint(str(src), storage_options, objects_url=src_objects_url) as ckpt:
        members: dict[str, set[str]] = {}
        for name, (_, info) in ckpt.tensors.items():
            members.setdefault(object_group(name, info.nbytes), set()).add(name)
        group_of = {n: g for g, names in members.items() for n in names}
        metadata = {k: v for s in ckpt.shards for k, v in s.header.metadata.items()}

    waiting: dict[str, list[tuple[str, torch.Tensor]]] = {}
    weight_map: dict[str, str] = {}
    summary: dict[str, Any] = {"tensors": 0, "objects": 0, "objects_written": 0, "objects_reused": 0,
                               "bytes_written": 0, "stale_temp_removed": dst.remove_stale_temp(objects_dir)}
    for name, t in iter_tensors(src, storage_options=storage_options, objects_url=src_objects_url, **opts):
        g = group_of[name]
        waiting.setdefault(g, []).append((name, t))
        if len(waiting[g]) < len(members[g]):
            continue
        fname, chunks = _object(waiting.pop(g))
        path = (objs.join(fname) if objs else dst.join("objects", fname))
        summary["objects"] += 1
        if dst.intact(path, fname):
            summary["objects_reused"] += 1
        else:
            dst.write(path, chunks)
            summary["objects_written"] += 1
            summary["bytes_written"] += sum(len(c) for c in chunks)
        for n in members[g]:
            weight_map[n] = posixpath.join(rel.replace(os.sep, "/"), fname)
        summary["tensors"] += len(members[g])
    index = {"metadata": {**metadata, "format": CAS_LAYOUT,
                          "total_size": str(sum(i.nbytes for _, i in ckpt.tensors.values()))},
             "weight_map": dict(sorted(weight_map.items()))}
    index_path = dst.join("model" + INDEX_SUFFIX)
    dst.write(index_path, [json.dumps(index, indent=1).encode()])
    summary["index"] = index_path if dst.local else f"{dst_url.rstrip('/')}/model{INDEX_SUFFIX}"
    return summary
