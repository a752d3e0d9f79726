"""The one check of a remote tier's fsspec URL, shared by the config parser and the tier (no I/O)."""

from __future__ import annotations

import urllib.parse

from .errors import ConfigError


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
