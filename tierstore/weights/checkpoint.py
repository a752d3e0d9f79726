"""Checkpoint discovery: a URI → its shards, each with a validated header.

``uri`` is one ``.safetensors`` file, an HF-style ``*.safetensors.index.json``, or a directory / prefix
holding either (an index wins over a plain listing), local or any fsspec URL. Every shard's header is
read (through the range cache when there is one) and validated before any tensor data is read, and the
index is checked against the headers: a shard it names must exist and hold the tensors it says, and no
tensor may appear in two shards.
"""

from __future__ import annotations

import json
import os
import posixpath
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from .cache import RangeCache, read_bytes
from .digest import expected_digest
from .header import (
    MAX_HEADER_SIZE,
    PREFIX_SIZE,
    CheckpointError,
    CheckpointNotFoundError,
    ShardHeader,
    TensorInfo,
    header_length,
    parse_header,
)
from .sources import FsspecSource, LocalFileSource, Source, filesystem, is_local, local_path

INDEX_SUFFIX = ".safetensors.index.json"
MAX_INDEX_SIZE = 64 * 1024 * 1024
HEADER_PROBE = 256 * 1024  # first read per shard; most headers fit, bigger ones take one more read
CAS_LAYOUT = "tierstore-cas/1"  # index metadata of a published, content-addressed checkpoint


@dataclass
class Shard:
    source: Source
    header: ShardHeader
    #: the hex digest a content-addressed object's name promises (None for other files) and the bytes
    #: before its data, which the digest check starts from
    digest: str | None = None
    head: bytes = b""


@dataclass
class Checkpoint:
    """Opened shards and where each tensor lives; close() releases file handles."""

    uri: str
    shards: list[Shard]
    tensors: dict[str, tuple[int, TensorInfo]]  # name -> (shard index, info)

    @property
    def nbytes(self) -> int:
        return sum(info.nbytes for _, info in self.tensors.values())

    def check_unchanged(self) -> None:
        """Raise :class:`CheckpointError` if a shard's name now leads to another version of it: shards
        replaced one by one (``mv``, ``rsync``) during a load must not give a mix of two checkpoints.
        Checked once every shard is open, and again when a load ends."""
        for s in self.shards:
            s.source.check_unchanged()

    def close(self) -> None:
        for s in self.shards:
            s.source.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_header(source: Source, cache: RangeCache | None, max_header_size: int) -> tuple[ShardHeader, bytes]:
    """Read and validate ``source``'s header with one ranged read (two when it is large); also return
    the file's bytes before its data (prefix and header)."""
    probe = min(source.size, HEADER_PROBE)
    head = read_bytes(source, 0, probe, cache) if probe else b""
    n = header_length(source.name, head, source.size, max_header_size)
    if PREFIX_SIZE + n > len(head):
        head += read_bytes(source, len(head), PREFIX_SIZE + n - len(head), cache)
    return parse_header(source.name, head[PREFIX_SIZE:PREFIX_SIZE + n], source.size), head[:PREFIX_SIZE + n]


class _Opener:
    """Filesystem-neutral helpers: list a directory, open a file as a Source."""

    def __init__(self, uri: str, storage_options: dict[str, Any] | None, concurrency: int):
        self.local = is_local(uri)
        self.fs: Any  # an fsspec filesystem; None for local paths
        if self.local:
            self.fs, self.path = None, local_path(uri)
        else:
            self.fs, self.path = filesystem(uri, storage_options, concurrency)
        self._infos: dict[str, dict[str, Any]] = {}

    def kind(self, path: str) -> str | None:
        if self.local:
            return "directory" if os.path.isdir(path) else "file" if os.path.exists(path) else None
        try:
            info = self.fs.info(path)
        except FileNotFoundError:
            return None
        return "directory" if info.get("type") == "directory" else "file"

    def listdir(self, path: str) -> list[str]:
        if self.local:
            return sorted(os.path.join(path, n) for n in os.listdir(path))
        entries = self.fs.ls(path, detail=True)
        for e in entries:
            if e.get("type") == "file":
                self._infos[e["name"].rstrip("/")] = e
        return sorted(e["name"].rstrip("/") for e in entries if e.get("type") == "file")

    def join(self, base: str, name: str) -> str:
        return os.path.normpath(os.path.join(base, name)) if self.local else posixpath.normpath(
            posixpath.join(base, name))

    def root(self, url: str) -> str:
        """``url`` as a normalised path on this filesystem (for :meth:`inside`)."""
        if self.local:
            return os.path.normpath(os.path.abspath(local_path(url)))
        return posixpath.normpath(str(self.fs._strip_protocol(url)))

    def inside(self, path: str, root: str) -> bool:
        """Whether normalised ``path`` lies under ``root``, lexically (symlinks inside, such as a
        Hugging Face snapshot's links to its blobs, are the checkpoint owner's business)."""
        sep = os.sep if self.local else "/"
        return path.startswith(root.rstrip(sep) + sep)

    def dirname(self, path: str) -> str:
        return os.path.dirname(path) if self.local else posixpath.dirname(path)

    def open(self, path: str) -> Source:
        if self.local:
            return LocalFileSource(path)
        info = self._infos.get(path) or self.fs.info(path)
        return FsspecSource(self.fs, path, info)

    def display(self, path: str) -> str:
        if self.local:
            return path
        proto = self.fs.protocol[0] if isinstance(self.fs.protocol, (tuple, list)) else self.fs.protocol
        return f"{proto}://{path}"


def _parse_index(name: str, data: bytes) -> tuple[dict[str, str], dict[str, Any]]:
    try:
        raw = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # bad UTF-8 or JSON, over-long integers, deep nesting
        raise CheckpointError(name, f"index is not valid JSON: {type(exc).__name__}: {exc}") from None
    wmap = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(wmap, dict) or not wmap:
        raise CheckpointError(name, "index has no 'weight_map' object")
    for tensor, file in wmap.items():
        if (not isinstance(file, str) or not file.endswith(".safetensors") or file.startswith("/")
                or "://" in file or "\\" in file):
            raise CheckpointError(name, f"weight_map entry {file!r} is not a relative .safetensors path",
                                  tensor)
    meta = raw.get("metadata") if isinstance(raw.get("metadata"), dict) else {}
    return wmap, meta


def open_checkpoint(uri: str, storage_options: dict[str, Any] | None = None, cache: RangeCache | None = None,
                    concurrency: int = 16, max_header_size: int | None = None,
                    objects_url: str | Sequence[str] | None = None) -> Checkpoint:
    """Resolve ``uri`` to shards and validate every header and the index.

    An index may name shards only under its own directory, or under ``objects_url`` (one URL or several,
    on the same filesystem): where :func:`~tierstore.weights.publish` put the objects it shares between
    checkpoints. A ``..`` leading anywhere else is refused, so an index cannot make the loader read other
    files the caller's credentials reach.

    Raises:
        CheckpointNotFoundError: ``uri`` or a shard the index names does not exist.
        CheckpointError: a malformed header or index, a shard outside the allowed places, or a tensor
            found in two shards.
    """
    max_header_size = MAX_HEADER_SIZE if max_header_size is None else max_header_size
    op = _Opener(uri, storage_options, concurrency)
    kind = op.kind(op.path)
    if kind is None:
        raise CheckpointNotFoundError(uri, "no such file or directory")
    index_path, files = None, []
    if kind == "directory":
        listing = op.listdir(op.path)
        indexes = [p for p in listing if p.endswith(INDEX_SUFFIX)]
        preferred = [p for p in indexes if os.path.basename(p) == "model" + INDEX_SUFFIX]
        if preferred or len(indexes) == 1:
            index_path = (preferred or indexes)[0]
        else:
            files = [p for p in listing if p.endswith(".safetensors")]
            if not files:
                raise CheckpointNotFoundError(uri, "directory holds no .safetensors files")
    elif op.path.endswith(".json"):
        index_path = op.path
    else:
        files = [op.path]

    expected: dict[str, list[str]] = {}  # shard path -> tensors the index places there
    content_addressed = False  # a published checkpoint: its objects are named by their digests
    if index_path is not None:
        src = op.open(index_path)
        try:
            if src.size > MAX_INDEX_SIZE:
                raise CheckpointError(src.name, f"index is {src.size} bytes, over the {MAX_INDEX_SIZE} cap")
            wmap, meta = _parse_index(src.name, read_bytes(src, 0, src.size, cache))
            content_addressed = meta.get("format") == CAS_LAYOUT
        finally:
            src.close()
        base = op.dirname(index_path)
        roots = [base] + [op.root(u) for u in ([objects_url] if isinstance(objects_url, str)
                                               else objects_url or [])]
        for tensor, rel in wmap.items():
            path = op.join(base, rel)
            if not any(op.inside(path, r) for r in roots):
                raise CheckpointError(src.name, f"weight_map entry {rel!r} leads outside the checkpoint "
                                                "(pass objects_url= to allow a shared objects location)", tensor)
            expected.setdefault(path, []).append(tensor)
        files = sorted(expected)

    def _open(path: str) -> Shard:
        try:
            source = op.open(path)
        except FileNotFoundError:
            named = expected.get(path, [None])[0]
            raise CheckpointNotFoundError(op.display(path), "shard named by the index does not exist"
                                          if named else "no such file", named) from None
        try:
            header, head = read_header(source, cache, max_header_size)
            digest = expected_digest(posixpath.basename(path.replace(os.sep, "/"))) if content_addressed else None
            return Shard(source, header, digest, head if digest else b"")
        except BaseException:
            source.close()
            raise

    with ThreadPoolExecutor(max(1, min(concurrency, len(files)))) as pool:
        futures = [pool.submit(_open, p) for p in files]
        shards, error = [], None
        for f in futures:
            try:
                shards.append(f.result())
            except BaseException as exc:  # keep the first error, close what did open
                error = error or exc
    if error is not None:
        for s in shards:
            s.source.close()
        raise error

    ckpt = Checkpoint(uri, shards, {})
    try:
        for i, (path, shard) in enumerate(zip(files, shards, strict=True)):
            names = shard.header.by_name()
            for tensor in expected.get(path, ()):
                if tensor not in names:
                    raise CheckpointError(shard.source.name, "named by the index but absent from the shard",
                                          tensor)
            for info in shard.header.tensors:
                if info.name in ckpt.tensors:
                    other = shards[ckpt.tensors[info.name][0]].source.name
                    raise CheckpointError(shard.source.name, f"also present in {other}", info.name)
                ckpt.tensors[info.name] = (i, info)
        ckpt.check_unchanged()
    except BaseException:
        ckpt.close()
        raise
    return ckpt
