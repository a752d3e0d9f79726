"""A remote tier's options, checked before anything is opened (shared by the config parser and the tier).

One place decides what a usable remote URL, endpoint, timeout … is, so ``tierstore.open(config)`` and
``RemoteTier(...)`` accept and refuse the same things, with a :class:`ConfigError` naming the key.
No check does I/O.
"""

from __future__ import annotations

import math
import urllib.parse
from collections.abc import Mapping

from .errors import ConfigError

COMPRESSIONS = (None, "none", "zstd")

#: why a remote tier takes no ``capacity``
CAPACITY_REFUSED = (
    "a remote tier has no capacity: its prefix is shared, and a per-process LRU would delete other writers' "
    "fresh objects. Bound it with bucket lifecycle rules (S3/GCS expiration) or `tierstore gc --older-than`")


def check_remote_options(where: str, url: object, storage_options: object = None, compression: object = None,
                         max_in_flight: object = 8, timeout: object = None, capacity: object = None,
                         list_on_open: object = True) -> None:
    """Raise :class:`ConfigError` naming ``<where>.<key>`` for the first unusable option (keyword names are
    the config keys of a remote tier)."""
    if capacity is not None:
        raise ConfigError(f"{where}.capacity: {CAPACITY_REFUSED}")
    check_url(url, f"{where}.url")
    if storage_options is not None:
        if not isinstance(storage_options, Mapping):
            raise ConfigError(f"{where}.storage_options: expected a mapping, got {storage_options!r}")
        if storage_options.get("endpoint_url") is not None:
            check_endpoint(storage_options["endpoint_url"], f"{where}.storage_options.endpoint_url")
    if compression not in COMPRESSIONS:
        raise ConfigError(f"{where}.compression: {compression!r} is not one of null | none | zstd")
    if not isinstance(max_in_flight, int) or isinstance(max_in_flight, bool) or max_in_flight < 1:
        raise ConfigError(f"{where}.max_in_flight: expected a positive integer, got {max_in_flight!r}")
    if not isinstance(list_on_open, bool):
        raise ConfigError(f"{where}.list_on_open: expected true or false, got {list_on_open!r}")
    if timeout is not None and (not isinstance(timeout, (int, float)) or isinstance(timeout, bool)
                                or not 0 < timeout < math.inf):
        raise ConfigError(f"{where}.timeout: expected a positive number of seconds, got {timeout!r}")


def check_url(url: object, key: str) -> str:
    """Return ``url`` if it is a usable fsspec URL, else raise :class:`ConfigError` naming ``key``.

    Every part of an fsspec chain (``simplecache::s3://bucket/kv``) must parse as a URL (not
    ``http://[::1``, no non-numeric port, no control characters) and name a protocol fsspec knows and
    can import; a part without a protocol is a local path.
    """
    import fsspec  # here: parsing a config without a remote tier should not import it

    if not isinstance(url, str) or not url:
        raise ConfigError(f"{key}: expected an fsspec URL such as s3://bucket/prefix, got {url!r}")
    for part in url.split("::"):
        check_endpoint(part, key, what="URL")
        protocol, _ = fsspec.core.split_protocol(part)
        if protocol is None:
            continue
        if protocol not in fsspec.available_protocols():
            raise ConfigError(f"{key}: unknown URL scheme {protocol!r} in {url!r}")
        try:
            fsspec.get_filesystem_class(protocol)
        except (ImportError, ValueError) as exc:
            raise ConfigError(f"{key}: scheme {protocol!r} of {url!r} needs a package that is not installed: "
                              f"{exc}") from None
    return url


def check_endpoint(url: object, key: str, what: str = "endpoint URL") -> None:
    """Raise :class:`ConfigError` unless ``url`` is a string without control characters that parses as a
    URL with a valid port."""
    if not isinstance(url, str):
        raise ConfigError(f"{key}: {what} must be a string, got {url!r}")
    if any(ord(c) < 0x20 or c == "\x7f" for c in url):
        raise ConfigError(f"{key}: {what} {url!r} contains control characters")
    try:
        urllib.parse.urlsplit(url).port  # noqa: B018 - reading the port is what validates it
    except ValueError as exc:
        raise ConfigError(f"{key}: malformed {what} {url!r}: {exc}") from None
