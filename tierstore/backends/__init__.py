"""Storage backends, registered by kind (the ``kind:`` of a config's tier entry).

Built in: ``host`` and ``device`` (:mod:`.memory`), ``disk`` (:mod:`.file`), ``remote`` (:mod:`.fsspec`, any
fsspec URL). A third-party backend that passes the conformance suite (:class:`tierstore.testing.BackendTests`)
is named in a config once registered, like fsspec's ``register_implementation``::

    tierstore.backends.register_backend("mykv", "mypackage.kv:MyBackend")   # or the class itself

or declared by its distribution as an entry point in the ``tierstore.backends`` group. Modules load lazily:
s3fs is imported only by a ``remote`` tier on ``s3://``.
"""

from __future__ import annotations

import importlib
import threading
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError

if TYPE_CHECKING:  # the names below load lazily (torch comes with them), for type checkers and IDEs
    from .base import Backend, Capabilities, Hit, Listed, Prepared, ReadResult

_BUILT_IN = {
    "device": "tierstore.backends.memory:DeviceBackend",
    "host": "tierstore.backends.memory:HostBackend",
    "disk": "tierstore.backends.file:FileBackend",
    "remote": "tierstore.backends.fsspec:FsspecBackend",
}
_registry: dict[str, str | type[Backend]] = dict(_BUILT_IN)
_BASE_NAMES = {"Backend", "Capabilities", "Hit", "Listed", "Prepared", "ReadResult"}


def __getattr__(name: str) -> Any:
    if name in _BASE_NAMES:
        from . import base

        return getattr(base, name)
    raise AttributeError(f"module 'tierstore.backends' has no attribute {name!r}")
_lock = threading.Lock()
_ENTRY_POINTS = "tierstore.backends"


def register_backend(kind: str, backend: str | type[Backend], *, replace: bool = False) -> None:
    """Make ``kind`` name ``backend`` (a :class:`Backend` subclass, or ``"module:Class"`` imported on first use).

    Raises :class:`~tierstore.ConfigError` if ``kind`` is taken (unless ``replace``) or not a plain name."""
    if not isinstance(kind, str) or not kind.isidentifier():
        raise ConfigError(f"backend kind must be a plain name, got {kind!r}")
    from .base import Backend

    if not isinstance(backend, str) and not (isinstance(backend, type) and issubclass(backend, Backend)):
        raise ConfigError(f"backend {kind!r} must be a Backend subclass or 'module:Class', got {backend!r}")
    with _lock:
        if kind in _registry and not replace:
            raise ConfigError(f"backend kind {kind!r} is registered already")
        _registry[kind] = backend


def known_kinds() -> list[str]:
    """Every kind a config may name: registered ones and the ``tierstore.backends`` entry points."""
    with _lock:
        kinds = set(_registry)
    kinds.update(ep.name for ep in entry_points(group=_ENTRY_POINTS))
    return sorted(kinds, key=lambda k: (k not in _BUILT_IN, k))


def backend_class(kind: str) -> type[Backend]:
    """The class registered for ``kind`` (imported now if it was registered by name)."""
    with _lock:
        target = _registry.get(kind)
    if target is None:
        found = [ep for ep in entry_points(group=_ENTRY_POINTS) if ep.name == kind]
        if not found:
            raise ConfigError(f"unknown backend kind {kind!r} (one of {', '.join(known_kinds())})")
        target = found[0].value
    if isinstance(target, str):
        from .base import Backend

        module, _, attr = target.partition(":")
        try:
            target = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"backend {kind!r}: cannot load {module}:{attr} ({exc})") from None
        if not (isinstance(target, type) and issubclass(target, Backend)):
            raise ConfigError(f"backend {kind!r}: {module}:{attr} is not a Backend subclass")
        with _lock:
            _registry[kind] = target
    return target


__all__ = ["Backend", "Capabilities", "Hit", "Listed", "Prepared", "ReadResult", "backend_class", "known_kinds",
           "register_backend"]
