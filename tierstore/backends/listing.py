"""Walking a remote prefix page by page: every file under it, with its size and modification time.

A listing of a shared prefix can be long (100,000 objects are 100 S3 LIST requests; on the local S3 server
that is over 30 seconds), so each page gets its own deadline rather than the whole walk one, and each file
becomes one small :class:`Listed` instead of an fsspec detail dict (a million of those would be a
gigabyte). S3: ListObjectsV2 pages of 1,000 keys; a local mount: ``os.scandir``, never following a symlink;
any other filesystem: fsspec's ``find`` under one deadline.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime
from typing import Any, NamedTuple


class Listed(NamedTuple):
    """A file under the prefix: its path relative to the root, size in bytes and last modification (epoch
    seconds, 0 when the storage does not say)."""

    rel: str
    size: int
    mtime: float


def mtime_of(info: Mapping[str, Any]) -> float:
    """Modification time of a listing entry or HEAD answer across fsspec implementations (0 when unknown)."""
    for field in ("LastModified", "mtime", "updated", "created"):
        v = info.get(field)
        if isinstance(v, datetime):
            return v.timestamp()
        if isinstance(v, (int, float)):
            return float(v)
    return 0.0


def walk_s3(call_s3: Callable[..., Mapping[str, Any]], bucket: str, prefix: str) -> Iterator[Listed]:
    """Every object under ``bucket/prefix/``; ``call_s3(params)`` sends one ListObjectsV2 request (under its
    own deadline) and returns its answer."""
    start = prefix.rstrip("/") + "/" if prefix else ""
    params: dict[str, Any] = {"Bucket": bucket, "Prefix": start, "MaxKeys": 1000}
    while True:
        page = call_s3(params)
        for obj in page.get("Contents", ()):
            name = obj.get("Key", "")
            if name.startswith(start) and not name.endswith("/"):
                yield Listed(name[len(start):], int(obj.get("Size") or 0), mtime_of(obj))
        token = page.get("NextContinuationToken")
        if not page.get("IsTruncated") or not token:
            return
        params = {**params, "ContinuationToken": token}


def walk_local(root: str) -> Iterator[Listed]:
    """Every regular file under ``root`` (a missing root is empty); symlinks are neither followed nor listed."""
    stack = [""]
    while stack:
        rel_dir = stack.pop()
        try:
            entries = os.scandir(os.path.join(root, rel_dir) if rel_dir else root)
        except (FileNotFoundError, NotADirectoryError):
            continue
        with entries:
            for entry in entries:
                rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue  # removed meanwhile
                if stat.S_ISDIR(st.st_mode):
                    stack.append(rel)
                elif stat.S_ISREG(st.st_mode):
                    yield Listed(rel, st.st_size, st.st_mtime)


def walk_fs(find: Callable[[], Mapping[str, Mapping[str, Any]]], root: str) -> Iterator[Listed]:
    """Every file ``find()`` (an fsspec ``find(root, detail=True)``) names under ``root``."""
    for path, info in find().items():
        if info.get("type", "file") == "file" and path.startswith(root):
            yield Listed(path[len(root):].lstrip("/"), int(info.get("size") or 0), mtime_of(info))
