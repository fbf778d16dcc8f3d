"""The `/metrics` endpoint: a small HTTP server in the service's own event loop.

Not prometheus_client's thread: collecting reads the service's tables on
the loop that changes them, and the recorder's refresh can await its
database query. `runtime.serve()` starts one (`MetricsServer`) for every
Program when `LORAFLEET_METRICS_ADDR` is set (off by default); `GET
/metrics` runs the live gauges' refreshers, then answers with the
process-wide registry (`lorafleet.metrics`). `child_addr` and
`endpoints_text` spread and list the addresses of several processes on one
machine (`lorafleet up`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping

from prometheus_client import REGISTRY
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from lorafleet import metrics
from lorafleet.settings import SettingsError, parse_host_port

# --- the endpoint ---------------------------------------------------------------

#: Seconds a client has to send its request line and headers.
REQUEST_HEAD_TIMEOUT_S = 5.0


def exposition() -> bytes:
    """The process's metrics in Prometheus's text format (without refreshing)."""
    return generate_latest(REGISTRY)


class MetricsServer:
    """`GET /metrics` on `addr` ("host:port"; port 0 picks a free one).

    start() binds (a port in use raises SettingsError naming the setting);
    `url` is where it listens; stop() closes it.
    """

    def __init__(self, addr: str, setting: str = "LORAFLEET_METRICS_ADDR") -> None:
        self.addr = addr
        self.setting = setting
        self.host, self.port = parse_host_port(addr, setting)
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        host = self.host or "0.0.0.0"
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}/metrics"

    async def start(self) -> None:
        try:
            self._server = await asyncio.start_server(self._handle, self.host or None, self.port)
        except OSError as e:
            raise SettingsError(
                f"{self.setting}={self.addr!r}: cannot listen there ({e.strerror}); "
                "choose a free port (0 picks one), or unset it to serve no metrics"
            ) from None
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_HEAD_TIMEOUT_S)
            writer.write(await respond(head))
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
            pass
        except ConnectionError:
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


async def respond(head: bytes) -> bytes:
    """The whole HTTP/1.1 response to a request's head."""
    parts = head.split(b"\r\n", 1)[0].split()
    method, path = (parts[0], parts[1].split(b"?", 1)[0]) if len(parts) >= 2 else (b"", b"")
    if method not in (b"GET", b"HEAD"):
        return _response(405, b"text/plain", b"GET /metrics\n", method == b"HEAD")
    if path == b"/metrics":
        await metrics.LIVE.refresh()
        return _response(200, CONTENT_TYPE_LATEST.encode(), exposition(), method == b"HEAD")
    if path == b"/":
        return _response(200, b"text/plain", b"lorafleet: metrics at /metrics\n", False)
    return _response(404, b"text/plain", b"not found: metrics are at /metrics\n", False)


_REASONS = {200: b"OK", 404: b"Not Found", 405: b"Method Not Allowed"}


def _response(status: int, content_type: bytes, body: bytes, head_only: bool) -> bytes:
    lines = [
        b"HTTP/1.1 %d %s" % (status, _REASONS[status]),
        b"Content-Type: " + content_type,
        b"Content-Length: %d" % len(body),
        b"Connection: close",
    ]
    return b"\r\n".join(lines) + b"\r\n\r\n" + (b"" if head_only else body)


# --- several processes on one machine (lorafleet up) ------------------------------


def child_addr(base: str, index: int, setting: str = "LORAFLEET_METRICS_ADDR") -> str:
    """The address of the `index`-th process when they share `base`: the
    port plus `index` (port 0 stays 0: each picks its own). "" stays off."""
    if not base:
        return ""
    host, port = parse_host_port(base, setting)
    if port == 0:
        return base
    host = f"[{host}]" if ":" in host else host
    return f"{host}:{port + index}"


def endpoints_text(urls: Mapping[str, str]) -> str:
    """Lines saying where each process serves its metrics (for `lorafleet up`)."""
    if not urls:
        return "metrics: off (set LORAFLEET_METRICS_ADDR, e.g. 127.0.0.1:9460, to serve them)"
    width = max(map(len, urls))
    return "\n".join(f"metrics: {name:<{width}}  {url}" for name, url in urls.items())
