"""An S3-like latency/bandwidth shim and fault injector: a small HTTP proxy in front of a local S3 server.

Real S3 answers a GET after ~20 ms and streams one connection at ~90 MB/s (AWS's own guidance: "one
concurrent request for each 85–90 MB/s"); a local ``moto_server`` does neither, so loaders that win on
S3 by running many ranged GETs at once look no better than a single stream against it. This proxy adds
both limits per request (a connection serves one request at a time), forwards everything else
unchanged and counts requests (:meth:`S3Shim.stats`), which tests use to count real remote reads.

It also plays a sick endpoint (:meth:`S3Shim.set_fault`), for the tests that prove a remote tier is
never stuck: ``refuse`` (nothing listens: connection refused), ``reset`` (connections are reset),
``blackhole`` (requests are read and never answered), ``slow`` (each answer ``delay`` seconds late) and
``status`` (every request answered with an S3 error, 503 SlowDown by default); ``methods`` limits a fault
to some HTTP methods (``status=403, methods=["HEAD"]`` is a least-privilege bucket).

It is bounded: it listens on 127.0.0.1 only and exits when its parent closes its stdin (the parent
exited) or after ``lifetime`` seconds, whichever comes first. The parent controls it through that pipe
(one JSON command a line, one JSON answer a line), so stats and healing work in every fault mode.

Run: ``python -m tierstore.bench.s3shim --upstream http://127.0.0.1:5000 --port 0`` (prints the port), or
``with S3Shim(upstream) as shim: shim.endpoint_url``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any

_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
        "transfer-encoding", "upgrade", "host", "content-length", "expect"}
CHUNK = 64 * 1024
FAULTS = ("pass", "refuse", "reset", "blackhole", "slow", "status")
_S3_CODES = {403: "AccessDenied", 404: "NoSuchKey", 500: "InternalError", 502: "BadGateway",
             503: "SlowDown", 504: "GatewayTimeout"}


def _reset_connection(request: Any) -> None:
    """Abort the client's connection with a TCP RST (what a crashed or firewalled backend looks like)."""
    sock = request.transport.get_extra_info("socket") if request.transport else None
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    if request.transport:
        request.transport.abort()


def serve(upstream: str, port: int, latency: float, bandwidth: float, lifetime: float) -> None:
    from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

    stats: dict[str, Any] = {"requests": 0, "by_method": {}, "gets": {}, "bytes_out": 0, "bytes_in": 0,
                             "faults": 0, "round_trips": 0, "lists": 0, "copies": 0, "bulk_deletes": 0}
    done_depth = 0  # the deepest chain of requests answered so far (see round_trips in S3Shim.stats)
    fault: dict[str, Any] = {"mode": "pass", "status": 503, "delay": 0.0, "methods": None}
    stopped = asyncio.Event()
    session: ClientSession | None = None

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        nonlocal done_depth
        depth = done_depth + 1  # this request may have waited for every one answered before it began
        stats["round_trips"] = max(stats["round_trips"], depth)
        try:
            return await forward(request)
        finally:
            done_depth = max(done_depth, depth)

    async def forward(request: web.BaseRequest) -> web.StreamResponse:
        t0 = time.monotonic()
        stats["requests"] += 1
        stats["by_method"][request.method] = stats["by_method"].get(request.method, 0) + 1
        if request.method == "GET" and request.query_string == "":
            stats["gets"][request.path] = stats["gets"].get(request.path, 0) + 1
        elif request.method == "GET" and "list-type" in request.query:
            stats["lists"] += 1
        elif request.method == "PUT" and "x-amz-copy-source" in request.headers:
            stats["copies"] += 1
        elif request.method == "POST" and "delete" in request.query:
            stats["bulk_deletes"] += 1
        mode = fault["mode"]
        if mode != "pass" and (fault["methods"] is None or request.method in fault["methods"]):
            stats["faults"] += 1
            if mode in ("reset", "refuse"):  # refuse: a kept-alive connection to a dead server is reset
                _reset_connection(request)
                return web.Response()  # never sent: the connection is gone
            if mode == "blackhole":
                await request.content.read()
                await stopped.wait()  # never answer; the process is exiting when this returns
                return web.Response(status=503)
            if mode == "status":
                await request.content.read()
                code = _S3_CODES.get(fault["status"], "ServiceUnavailable")
                body = b"" if request.method == "HEAD" else (
                    f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code><Message>injected by "
                    f"the s3 shim</Message></Error>").encode()
                return web.Response(status=fault["status"], body=body, content_type="application/xml")
        if request.headers.get("Expect", "").lower() == "100-continue":  # botocore PUTs ask for it
            await request.writer.write(b"HTTP/%d.%d 100 Continue\r\n\r\n" % request.version)
        body = await request.content.read()  # no 1 MiB client_max_size: objects are bigger
        stats["bytes_in"] += len(body)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        assert session is not None  # opened by main() before the server starts
        async with session.request(request.method, upstream + request.path_qs, headers=headers,
                                   data=body or None, allow_redirects=False) as up:
            out_headers = {k: v for k, v in up.headers.items() if k.lower() not in _HOP}
            wait = latency + (fault["delay"] if mode == "slow" else 0.0) - (time.monotonic() - t0)
            if wait > 0:
                await asyncio.sleep(wait)
            resp = web.StreamResponse(status=up.status, headers=out_headers)
            if up.content_length is not None:
                resp.content_length = up.content_length
            await resp.prepare(request)
            if request.method != "HEAD":
                start, sent = time.monotonic(), 0
                async for chunk in up.content.iter_chunked(CHUNK):
                    await resp.write(chunk)
                    sent += len(chunk)
                    stats["bytes_out"] += len(chunk)
                    if bandwidth:
                        ahead = sent / bandwidth - (time.monotonic() - start)
                        if ahead > 0:
                            await asyncio.sleep(ahead)
            await resp.write_eof()
            return resp

    async def control(runner: web.ServerRunner, site: web.TCPSite, bound: int) -> None:
        """Answer the parent's commands on stdin: ``{"op": "stats" | "reset" | "fault", …}``; EOF stops."""
        nonlocal done_depth
        reader = asyncio.StreamReader()
        await asyncio.get_running_loop().connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader),
                                                           sys.stdin)
        while line := await reader.readline():
            command = json.loads(line)
            op = command.pop("op")
            if op == "reset":
                stats.update(requests=0, by_method={}, gets={}, bytes_out=0, bytes_in=0, faults=0, round_trips=0,
                             lists=0, copies=0, bulk_deletes=0)
                done_depth = 0
            elif op == "fault":
                if command["mode"] == "refuse" and fault["mode"] != "refuse":
                    await site.stop()
                elif command["mode"] != "refuse" and fault["mode"] == "refuse":
                    site = web.TCPSite(runner, "127.0.0.1", bound, reuse_address=True)
                    await site.start()
                fault.update(command)
            print(json.dumps(stats), flush=True)

    async def main() -> None:
        nonlocal session
        session = ClientSession(connector=TCPConnector(limit=0), auto_decompress=False,
                                timeout=ClientTimeout(total=None), skip_auto_headers=("Content-Type",))
        runner = web.ServerRunner(web.Server(handle))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", port)
        await site.start()
        bound = runner.addresses[0][1]
        print(bound, flush=True)
        try:
            await asyncio.wait_for(control(runner, site, bound), lifetime)
        except TimeoutError:
            pass
        finally:
            stopped.set()
            await session.close()

    asyncio.run(main())


class S3Shim:
    """Run the shim in a subprocess in front of ``upstream``; a context manager."""

    def __init__(self, upstream: str, latency: float = 0.020, bandwidth: float = 90e6, lifetime: float = 6 * 3600.0):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tierstore.bench.s3shim", "--upstream", upstream, "--port", "0",
             "--latency-ms", str(latency * 1000), "--mbps", str(bandwidth / 1e6), "--lifetime", str(lifetime)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line.strip().isdigit():
            self.proc.kill()
            raise RuntimeError("s3 shim failed to start")
        self.port = int(line)
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self._lock = threading.Lock()

    def _command(self, op: str, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        with self._lock:
            self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
            self.proc.stdin.flush()
            answer = self.proc.stdout.readline()
        if not answer:
            raise RuntimeError(f"s3 shim exited (code {self.proc.poll()})")
        stats: dict[str, Any] = json.loads(answer)
        return stats

    def set_fault(self, mode: str = "pass", *, status: int = 503, delay: float = 0.0,
                  methods: Iterable[str] | None = None) -> None:
        """Make the endpoint fail from now on (``pass`` heals it): one of :data:`FAULTS`."""
        if mode not in FAULTS:
            raise ValueError(f"fault must be one of {', '.join(FAULTS)}, got {mode!r}")
        self._command("fault", mode=mode, status=status, delay=delay,
                      methods=None if methods is None else [m.upper() for m in methods])

    def stats(self) -> dict[str, Any]:
        """Requests seen so far: ``requests``, ``by_method``, ``gets`` (object GETs, per path), ``lists``
        (ListObjects), ``copies`` (server-side copies), ``bulk_deletes`` (DeleteObjects), ``bytes_out``
        (answers), ``bytes_in`` (request bodies: what PUTs uploaded), ``faults``,
        and ``round_trips``: the longest chain of requests each begun after the one before it was answered
        (requests sent together count once; 64 sent 32 at a time count twice), the number of latencies
        the client waited in sequence."""
        return self._command("stats")

    def reset(self) -> None:
        """Zero the counters."""
        self._command("reset")

    def storage_options(self, base: dict[str, Any]) -> dict[str, Any]:
        return {**base, "endpoint_url": self.endpoint_url}

    def close(self) -> None:
        from ..testing.s3 import stop_process

        if self.proc.stdin:
            self.proc.stdin.close()  # the shim's signal to exit
        stop_process(self.proc)
        if self.proc.stdout:
            self.proc.stdout.close()

    def __enter__(self) -> S3Shim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--upstream", required=True)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--mbps", type=float, default=90.0, help="MB/s per connection, 0 = unlimited")
    ap.add_argument("--lifetime", type=float, default=6 * 3600.0, help="exit after this many seconds")
    a = ap.parse_args()
    serve(a.upstream.rstrip("/"), a.port, a.latency_ms / 1000, a.mbps * 1e6, a.lifetime)
