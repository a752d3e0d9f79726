"""An S3-like latency/bandwidth shim: a small HTTP proxy in front of a local S3 server.

Real S3 answers a GET after ~20 ms and streams one connection at ~90 MB/s (AWS's own guidance: "one
concurrent request for each 85–90 MB/s"); a local ``moto_server`` does neither, so loaders that win on
S3 by running many ranged GETs at once look no better than a single stream against it. This proxy adds
both limits per request (a connection serves one request at a time), forwards everything else
unchanged, listens on 127.0.0.1 only and counts requests — ``GET /__shim__/stats`` returns them as JSON,
``POST /__shim__/reset`` zeroes them — which tests use to count real remote reads.

Run: ``python -m tierstore.bench.s3shim --upstream http://127.0.0.1:5000 --port 0`` (prints the port), or
``with S3Shim(upstream) as shim: shim.endpoint_url``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
import urllib.request
from typing import Any

_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
        "transfer-encoding", "upgrade", "host", "content-length", "expect"}
CHUNK = 64 * 1024


def serve(upstream: str, port: int, latency: float, bandwidth: float) -> None:
    from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

    stats: dict[str, Any] = {"requests": 0, "by_method": {}, "gets": {}, "bytes_out": 0}
    session: ClientSession | None = None

    async def handle(request: web.BaseRequest):
        if request.path == "/__shim__/stats":
            return web.json_response(stats)
        if request.path == "/__shim__/reset":
            stats.update(requests=0, by_method={}, gets={}, bytes_out=0)
            return web.json_response(stats)
        t0 = time.monotonic()
        stats["requests"] += 1
        stats["by_method"][request.method] = stats["by_method"].get(request.method, 0) + 1
        if request.method == "GET" and request.query_string == "":
            stats["gets"][request.path] = stats["gets"].get(request.path, 0) + 1
        if request.headers.get("Expect", "").lower() == "100-continue":  # botocore PUTs ask for it
            await request.writer.write(b"HTTP/%d.%d 100 Continue\r\n\r\n" % request.version)
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        assert session is not None  # opened by main() before the server starts
        async with session.request(request.method, upstream + request.path_qs, headers=headers,
                                   data=body or None, allow_redirects=False) as up:
            out_headers = {k: v for k, v in up.headers.items() if k.lower() not in _HOP}
            wait = latency - (time.monotonic() - t0)
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

    async def main():
        nonlocal session
        session = ClientSession(connector=TCPConnector(limit=0), auto_decompress=False,
                                timeout=ClientTimeout(total=None), skip_auto_headers=("Content-Type",))
        server = web.Server(handle)
        runner = web.ServerRunner(server)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", port)
        await site.start()
        print(runner.addresses[0][1], flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


class S3Shim:
    """Run the shim in a subprocess in front of ``upstream``; a context manager."""

    def __init__(self, upstream: str, latency: float = 0.020, bandwidth: float = 90e6):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tierstore.bench.s3shim", "--upstream", upstream, "--port", "0",
             "--latency-ms", str(latency * 1000), "--mbps", str(bandwidth / 1e6)],
            stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.strip().isdigit():
            self.proc.kill()
            raise RuntimeError("s3 shim failed to start")
        self.endpoint_url = f"http://127.0.0.1:{int(line)}"

    def stats(self) -> dict:
        with urllib.request.urlopen(self.endpoint_url + "/__shim__/stats", timeout=10) as r:
            return json.loads(r.read())

    def reset(self) -> None:
        urllib.request.urlopen(urllib.request.Request(self.endpoint_url + "/__shim__/reset", method="POST"),
                               timeout=10).close()

    def storage_options(self, base: dict) -> dict:
        return {**base, "endpoint_url": self.endpoint_url}

    def close(self) -> None:
        from ..testing.s3 import stop_process

        stop_process(self.proc)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--upstream", required=True)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--mbps", type=float, default=90.0, help="MB/s per connection, 0 = unlimited")
    a = ap.parse_args()
    serve(a.upstream.rstrip("/"), a.port, a.latency_ms / 1000, a.mbps * 1e6)
