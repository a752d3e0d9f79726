"""Calls to a remote filesystem that never leave the caller stuck.

:class:`GuardedStorage` wraps the fsspec filesystem of a remote tier. Every call has a deadline: on
asynchronous filesystems (s3, gcs, http …) the request itself is cancelled when it passes, and S3
clients also get bounded connect/read timeouts and retries (:data:`S3_CLIENT_DEFAULTS`). A timeout, a
connection failure or a 5xx answer marks the storage down: for ``retry_after`` seconds (doubling while
it stays down, up to ``max_retry_after``) calls raise at once without any I/O, so a dead endpoint costs
each caller a miss, not a stall. Synchronous filesystems (``file://``, ``memory://``) run unbounded:
a local mount blocks as the kernel does.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import fsspec
import torch

from ..errors import ClosedError, TierstoreError
from ..objformat import alloc_bytes
from .listing import mtime_of

T = TypeVar("T")

#: seconds one storage request may take by default; a KV chunk later than this is worth less than
#: recomputing it
DEFAULT_TIMEOUT = 5.0
#: botocore client settings for s3:// unless ``storage_options["config_kwargs"]`` sets them (botocore's
#: own defaults are 60 s connect and read timeouts with 5 attempts: minutes against a silent endpoint)
S3_CLIENT_DEFAULTS: dict[str, Any] = {"connect_timeout": 2, "read_timeout": 4,
                                      "retries": {"max_attempts": 3, "mode": "standard"}}

#: bytes taken from an S3 response body at a time while it is copied into its buffer
READ_CHUNK = 1 << 20

#: exceptions from a filesystem call that are bugs or bad arguments, not an unreachable storage
_PROGRAMMING_ERRORS = (TypeError, ValueError, AttributeError, LookupError, NotImplementedError, AssertionError)


class Unavailable(OSError):
    """The storage failed recently; raised without I/O until the back-off expires."""


#: the keyword arguments s3fs hands to the botocore session it creates (all it does not know itself)
#: s3fs options it passes to its botocore session (not the filesystem's own parameters)
SESSION_OPTIONS = {"profile", "session_vars", "event_hooks", "include_builtin_handlers"}
_sessions: dict[str | None, Any] = {}
_sessions_lock = threading.Lock()


def with_client_defaults(url: str, options: Mapping[str, Any], connections: int = 10) -> dict[str, Any]:
    """``options`` plus, for an ``s3://`` URL, :data:`S3_CLIENT_DEFAULTS` and a connection pool of
    ``connections`` (the user's values win, key by key) and this process's shared botocore session (see
    :func:`shared_session`) unless the options bring a ``session`` or session settings other than ``profile``."""
    options = dict(options)
    protocol, _ = fsspec.core.split_protocol(url.split("::")[-1])
    if protocol in ("s3", "s3a"):
        options["config_kwargs"] = {**S3_CLIENT_DEFAULTS, "max_pool_connections": connections,
                                    **(options.get("config_kwargs") or {})}
        profile = options.get("profile")
        if "session" not in options and SESSION_OPTIONS & set(options) <= {"profile"} and (
                profile is None or isinstance(profile, str)):
            options["session"] = shared_session(profile)
    return options


def shared_session(profile: str | None = None) -> Any:
    """One botocore (aiobotocore) session per profile for every s3 remote tier of this process.

    A session loads botocore's service models (megabytes of JSON, 0.1-0.4 s of CPU) on its first client;
    s3fs makes a session per filesystem, so every store opened paid that again before its first request.
    Shared, only the first does; each tier still gets its own client and connections (credentials,
    endpoint and ``config_kwargs`` are the client's). It also keeps fsspec's instance cache working: the
    same options name the same session.
    """
    with _sessions_lock:
        session = _sessions.get(profile)
        if session is None:
            from aiobotocore.session import AioSession

            session = _sessions[profile] = AioSession(profile=profile)
        return session


async def read_s3_object(fs: Any, path: str) -> tuple[torch.Tensor, float]:
    """The object at ``path`` of an s3fs filesystem as one flat uint8 tensor, from a single GET, and its
    ``Last-Modified`` (epoch seconds; 0 when the answer has none).

    s3fs's ``cat_file`` sends a HEAD before each GET (to split large objects into ranged reads); a KV
    chunk is read whole, so one GET does, and a missing key is its ``404`` (``FileNotFoundError``). The
    body is streamed into a buffer of the response's ``Content-Length`` (what is allocated is bounded by
    the object's real size), which :func:`tierstore.objformat.decode` then views without a copy.
    """
    bucket, key, _ = fs.split_path(path)
    response = await fs._call_s3("get_object", Bucket=bucket, Key=key)
    body = response["Body"]
    try:
        size = int(response["ContentLength"])
        buf = alloc_bytes(size)
        view = buf.numpy().data if size else memoryview(bytearray())
        pos = 0
        async for part in body.iter_chunks(READ_CHUNK):
            if pos + len(part) > size:
                raise OSError(f"{path}: the body is longer than its Content-Length {size}")
            view[pos:pos + len(part)] = part
            pos += len(part)
        if pos != size:
            raise OSError(f"{path}: the body ended after {pos} of {size} bytes")
        return buf, mtime_of(response)
    finally:
        body.close()


async def read_s3_range(fs: Any, path: str, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of the object at ``path`` of an s3fs filesystem, from one ranged GET (no HEAD);
    a missing key raises ``FileNotFoundError``."""
    bucket, key, _ = fs.split_path(path)
    response = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}")
    body = response["Body"]
    try:
        data: bytes = await body.read()
        return data
    finally:
        body.close()


def _raiser(exc: BaseException) -> Callable[[], Any]:
    def fn() -> Any:
        raise exc

    return fn


def _server_error(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is an HTTP 5xx answer: the service is failing, not the request."""
    seen: BaseException | None = exc
    for _ in range(4):
        if seen is None:
            return False
        status = (getattr(seen, "response", None) or {}).get("ResponseMetadata", {}).get("HTTPStatusCode")
        if isinstance(status, int) and status >= 500:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class GuardedStorage:
    """``fs`` behind a deadline per call and a back-off while it is down (see the module docstring).

    ``on_down(exc, seconds)`` is told when an outage starts (the tier logs it once).
    """

    #: seconds to fail fast after a failure (doubling while down, up to the max)
    retry_after: float = 1.0
    max_retry_after: float = 30.0

    def __init__(self, fs: Any, url: str, timeout: float, on_down: Callable[[BaseException, float], None]):
        self.fs = fs
        self.url = url
        self.timeout = timeout
        self._on_down = on_down
        self._async = bool(getattr(fs, "async_impl", False))
        #: batches on the event loop not finished yet (a closing backend waits for them, bounded)
        self.in_flight: set[concurrent.futures.Future[Any]] = set()
        self._health = threading.Lock()
        self._down_until = 0.0
        self._backoff = 0.0

    def call(self, name: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        """``fs.<name>(*args, **kwargs)`` within ``timeout`` (default :attr:`timeout`) seconds.

        Raises :class:`Unavailable` while backing off; other failures as ``OSError`` (botocore, aiohttp …
        errors are wrapped), a missed deadline as ``TimeoutError``.
        """
        if self._async:
            return self.run(name, lambda: getattr(self.fs, "_" + name)(*args, **kwargs), timeout)
        return self._guarded(lambda: getattr(self.fs, name)(*args, **kwargs))

    def run(self, what: str, make: Callable[[], Awaitable[T]], timeout: float | None = None) -> T:
        """``await make()`` on an asynchronous filesystem's event loop, guarded as :meth:`call` is; the
        whole coroutine (request and body) shares one deadline. ``what`` names it in a timeout message."""
        return self._guarded(lambda: self._on_loop(what, make, timeout or self.timeout))

    def gather(self, what: str, makers: Sequence[Callable[[], Awaitable[T]]], limit: int,
               timeout: float | None = None) -> list[T | BaseException]:
        """``await make()`` for every maker in one ``asyncio.gather`` on the filesystem's event loop, at most
        ``limit`` at a time, each under its own deadline (default :attr:`timeout`): the caller's thread waits on
        one future for the whole batch, not one per request. Each request is classified as :meth:`call` does
        (its exception, wrapped the same way, is its result); while the storage backs off every result is
        :class:`Unavailable`, without I/O. Asynchronous filesystems only."""
        if not makers:
            return []
        now = time.monotonic()
        if now < self._down_until:
            down = Unavailable(f"{self.url} is unreachable; next attempt in {self._down_until - now:.1f}s")
            return [down] * len(makers)
        deadline = timeout or self.timeout

        async def one(make: Callable[[], Awaitable[T]], gate: asyncio.Semaphore) -> T | BaseException:
            async with gate:
                now = time.monotonic()
                if now < self._down_until:  # an earlier request of the batch found the storage down
                    return Unavailable(f"{self.url} is unreachable; next attempt in {self._down_until - now:.1f}s")
                try:
                    result: T | BaseException = await asyncio.wait_for(make(), deadline)
                except asyncio.TimeoutError:
                    result = TimeoutError(f"{self.url}: {what} got no answer within {deadline:g}s")
                except Exception as exc:  # noqa: BLE001 - the item's result, once classified
                    result = exc
                classified: T | BaseException = self._classified(result)
                return classified

        async def batch() -> list[T | BaseException]:
            gate = asyncio.Semaphore(limit)
            return list(await asyncio.gather(*(one(m, gate) for m in makers)))

        future = asyncio.run_coroutine_threadsafe(batch(), self.fs.loop)
        self.in_flight.add(future)
        future.add_done_callback(self.in_flight.discard)
        waves = -(-len(makers) // max(1, limit))
        try:
            return future.result(deadline * waves + 1.0)  # the extra second covers a busy event loop
        except concurrent.futures.CancelledError:  # cancelled by a closing backend
            raise ClosedError(f"{self.url}: closed while {what} ran") from None
        except TimeoutError:
            future.cancel()
            late = TimeoutError(f"{self.url}: {what} of {len(makers)} got no answer in time")
            self._mark_down(late)
            return [late] * len(makers)

    def cancel(self) -> None:
        """Cancel the batches still running (their callers get :class:`~tierstore.ClosedError`)."""
        for future in list(self.in_flight):
            future.cancel()

    def _classified(self, result: Any) -> Any:
        """One request's outcome as :meth:`_guarded` sees it: the storage marked up or down, the error as it
        would be raised (wrapped in ``OSError`` where ``_guarded`` wraps it)."""
        if not isinstance(result, BaseException):
            self._mark_up()
            return result
        try:
            return self._guarded(_raiser(result), check=False)
        except BaseException as exc:  # noqa: BLE001 - the classified error is the result
            return exc

    def start_client(self) -> None:
        """Create an s3fs client in the background now (no request is sent), so that the first request
        does not wait for it; a failure here is retried by that request."""
        if self._async and hasattr(self.fs, "set_session"):
            asyncio.run_coroutine_threadsafe(self.fs.set_session(), self.fs.loop)

    def _guarded(self, fn: Callable[[], T], check: bool = True) -> T:
        now = time.monotonic()
        if check and now < self._down_until:
            raise Unavailable(f"{self.url} is unreachable; next attempt in {self._down_until - now:.1f}s")
        try:
            out = fn()
        except (FileNotFoundError, FileExistsError, TierstoreError):
            self._mark_up()  # the storage answered
            raise
        except (ConnectionError, TimeoutError) as exc:
            self._mark_down(exc)
            raise
        except OSError as exc:
            if _server_error(exc):
                self._mark_down(exc)
            raise
        except MemoryError:  # this host, not the storage
            raise
        except _PROGRAMMING_ERRORS as exc:
            raise OSError(f"{type(exc).__name__}: {exc}") from exc
        except Exception as exc:  # botocore / aiohttp / gcsfs network errors
            self._mark_down(exc)
            raise OSError(f"{type(exc).__name__}: {exc}") from exc
        self._mark_up()
        return out

    def _on_loop(self, what: str, make: Callable[[], Awaitable[T]], timeout: float) -> T:
        async def bounded() -> T:
            return await asyncio.wait_for(make(), timeout)

        future = asyncio.run_coroutine_threadsafe(bounded(), self.fs.loop)
        try:
            return future.result(timeout + 1.0)  # the extra second covers a busy event loop
        except TimeoutError as exc:
            future.cancel()
            raise TimeoutError(f"{self.url}: {what} got no answer within {timeout:g}s") from exc

    def _mark_down(self, exc: BaseException) -> None:
        with self._health:
            now = time.monotonic()
            if now < self._down_until:
                return  # concurrent failures of one outage extend nothing
            self._backoff = min(max(2 * self._backoff, self.retry_after), self.max_retry_after)
            self._down_until = now + self._backoff
        self._on_down(exc, self._backoff)

    @property
    def backoff(self) -> float:
        """Seconds requests fail fast for after the last failure; 0 while the storage answers."""
        return self._backoff

    def _mark_up(self) -> None:
        if self._backoff:
            with self._health:
                self._backoff = 0.0
                self._down_until = 0.0
