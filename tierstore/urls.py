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


def filesystem_options(protocol: str) -> set[str] | None:
    """The keyword options fsspec's filesystem class for ``protocol`` takes: the named parameters of every
    ``__init__`` in its class hierarchy, plus the listings-cache and instance-cache options every fsspec
    filesystem takes. ``None`` when that cannot be known (no class, or one that takes ``**kwargs`` it does
    not pass on to fsspec's base class)."""
    import inspect

    import fsspec
    from fsspec.dircache import DirCache

    try:
        cls = fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError):
        return None
    names = {"skip_instance_cache"} | set(inspect.signature(DirCache.__init__).parameters) - {"self", "kwargs"}
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None or klass is object:
            continue
        for p in inspect.signature(init).parameters.values():
            if p.kind is p.KEYWORD_ONLY or p.kind is p.POSITIONAL_OR_KEYWORD:
                names.add(p.name)
        if klass is fsspec.AbstractFileSystem:
            if protocol in ("s3", "s3a"):  # s3fs hands the rest to its botocore session
                from .backends.guarded import SESSION_OPTIONS

                names |= SESSION_OPTIONS
            return names - {"self"}
    return None


def check_storage_options(url: str, options: object, key: str) -> None:
    """Raise :class:`ConfigError` naming ``key.<option>`` for a ``storage_options`` key the URL's fsspec
    filesystem does not take (``endpoint_ur`` on ``s3://`` would otherwise be ignored, and the client would
    talk to the default endpoint), and for an ``endpoint_url`` that is not an ``http(s)://host`` URL (a
    placeholder such as ``"..."``). Chained URLs (``simplecache::s3://``) key their options by protocol and
    are not checked here."""
    import difflib

    import fsspec

    if not isinstance(options, dict) or "::" in url:
        return
    endpoint = options.get("endpoint_url")
    if endpoint is not None:
        check_endpoint(endpoint, f"{key}.endpoint_url")
        parts = urllib.parse.urlsplit(endpoint)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"{key}.endpoint_url: expected http(s)://host[:port], got {endpoint!r}")
    protocol = fsspec.core.split_protocol(url)[0] or "file"
    known = filesystem_options(protocol)
    if known is None:
        return
    for name in sorted(set(options) - known):
        close = difflib.get_close_matches(name, sorted(known), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        fs = fsspec.get_filesystem_class(protocol).__name__
        raise ConfigError(f"{key}.{name}: not an option of {protocol}:// ({fs}){hint}")
