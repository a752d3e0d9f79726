"""The measured loaders of ``tierstore bench weights``: raw limits, safetensors, tierstore, peers.

Each loader fills the same preallocated ``params`` (as an engine's ``load_weights`` does), so every row
measures bytes made resident in their destination, not a lazy mapping. A peer that is not installed
raises :class:`Unavailable` with the reason, and the bench prints it instead of a number.
"""

from __future__ import annotations

import os

import numpy as np
import torch

import tierstore.weights as tw


class Unavailable(Exception):
    """This row cannot run here; the message says why."""


def drop_caches() -> None:
    """Flush dirty pages and drop the page cache (needs root)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as exc:
        raise Unavailable(f"cannot drop the page cache ({exc.strerror})") from None


def memcpy_buffers(nbytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Two existing, touched buffers of ``nbytes`` for :func:`memcpy`."""
    return np.ones(nbytes, dtype=np.uint8), np.zeros(nbytes, dtype=np.uint8)


def memcpy(src: np.ndarray, dst: np.ndarray) -> None:
    """One-thread memcpy between existing buffers (numpy's copy does not spawn threads)."""
    np.copyto(dst, src)


def readinto(paths: list[str], buf: torch.Tensor) -> int:
    """Sequential ``readinto`` of each file into the existing ``buf``; returns bytes read."""
    view = buf.numpy().data
    total = 0
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            pos = 0
            while pos < size:
                n = f.readinto(view[pos:min(size, pos + (1 << 30))])
                if not n:
                    break
                pos += n
            total += pos
    return total


def safetensors_load_file(paths, params, **_):
    from safetensors.torch import load_file
    for p in paths:
        for name, t in load_file(p).items():
            params[name].copy_(t)


def safetensors_safe_open(paths, params, **_):
    from safetensors import safe_open
    for p in paths:
        with safe_open(p, framework="pt") as f:
            for name in f.keys():
                params[name].copy_(f.get_tensor(name))


def ours_load_into(paths, params, uri, concurrency=None, block_size=None, **_):
    opts = {k: v for k, v in (("concurrency", concurrency), ("block_size", block_size)) if v}
    tw.load_into(params, uri, **opts)


def ours_iter_copy(paths, params, uri, concurrency=None, block_size=None, **_):
    opts = {k: v for k, v in (("concurrency", concurrency), ("block_size", block_size)) if v}
    for name, t in tw.iter_tensors(uri, **opts):
        params[name].copy_(t)


def runai_streamer(paths, params, **_):
    try:
        from runai_model_streamer import SafetensorsStreamer
    except ImportError:
        raise Unavailable("not installed (pip install runai-model-streamer)") from None
    with SafetensorsStreamer() as s:
        s.stream_files(list(paths))
        for name, t in s.get_tensors():
            params[name].copy_(t)


def fastsafetensors_loader(paths, params, **_):
    try:
        from fastsafetensors import SafeTensorsFileLoader, SingleGroup
    except ImportError:
        raise Unavailable("not installed (pip install fastsafetensors)") from None
    loader = SafeTensorsFileLoader(SingleGroup(), "cpu", nogds=True)
    try:
        loader.add_filenames({0: list(paths)})
        fb = loader.copy_files_to_device()
        try:
            for name in params:
                params[name].copy_(fb.get_tensor(name))
        finally:
            fb.close()
    finally:
        loader.close()


def tensorizer_path(directory: str) -> str:
    return os.path.join(directory, "model.tensors")


def tensorizer_prepare(directory: str, params) -> str:
    """Serialize ``params`` once in tensorizer's own format (it does not read safetensors)."""
    try:
        from tensorizer import TensorSerializer
    except ImportError:
        raise Unavailable("not installed (pip install tensorizer)") from None
    path = tensorizer_path(directory)
    if not os.path.exists(path):  # written from loaded parameters, checked by every row's verification
        ser = TensorSerializer(path + ".tmp")
        ser.write_state_dict(params)
        ser.close()
        os.replace(path + ".tmp", path)
    return path


def tensorizer_loader(paths, params, directory=None, concurrency=None, **_):
    try:
        from tensorizer import TensorDeserializer
    except ImportError:
        raise Unavailable("not installed (pip install tensorizer)") from None
    path = tensorizer_path(directory)
    if not os.path.exists(path):
        raise Unavailable("tensorizer file missing")
    with TensorDeserializer(path, device="cpu", num_readers=concurrency or 8) as d:
        for name in params:
            params[name].copy_(d[name])


LOCAL_ROWS = [
    ("safetensors load_file + copy", safetensors_load_file),
    ("safetensors safe_open per tensor", safetensors_safe_open),
    ("tierstore load_into (direct)", ours_load_into),
    ("tierstore iter_tensors + copy", ours_iter_copy),
    ("Run:ai Model Streamer", runai_streamer),
    ("fastsafetensors (nogds, cpu)", fastsafetensors_loader),
    ("tensorizer (own format)", tensorizer_loader),
]
