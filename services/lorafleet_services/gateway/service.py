"""The gateway as a lorafleet service: uvicorn serving the app, on one NATS
connection (a lorafleet `Client` with the gateway's identity).

`start()` returns once the HTTP port is bound and answering; the
`service.started` line carries its `url` (with port 0, the one picked).
`stop()` stops taking requests, lets those in flight end, then closes the
engines' HTTP client.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

import httpx2
import uvicorn
from nats.aio.client import Client as Nats
from nats.js.kv import KeyValue

from lorafleet import _runtime as runtime
from lorafleet import log
from lorafleet._tasks import stop_tasks
from lorafleet.client import Client
from lorafleet.nats._bus import when_cluster_answers
from lorafleet.nats._kv_watch import KeyWatch, removed
from lorafleet.settings import Settings, SettingsError, parse_host_port
from lorafleet.training_data import check_lines
from lorafleet_services.gateway.api_keys import KeyRing
from lorafleet_services.gateway.app import make_app
from lorafleet_services.gateway.config import GatewayConfig
from lorafleet_services.gateway.context import GatewayContext
from lorafleet_services.gateway.fleet_model_location import (
    ConfiguredFirstLocator,
    FleetModelLocator,
)
from lorafleet_services.gateway.model_location import EngineModels, ModelLocation, ModelLocator
from lorafleet_services.gateway.replica_choice import METRICS_EVERY_S, Loads
from lorafleet_services.gateway.state import GatewayState
from lorafleet_services.gateway.uploads import CheckWorkers

#: Seconds requests in flight get to end at a stop.
IN_FLIGHT_GRACE_S = 5
#: Seconds between two looks at whether uvicorn has started.
STARTED_POLL_S = 0.01
#: Worker processes checking uploads' records (pieces of one upload are
#: checked in both at once; each costs a Python process, about 40 MB).
CHECK_WORKERS = 2


def _bind(addr: str) -> socket.socket:
    """The listening socket of `addr`; a port in use is a SettingsError (exit 2)."""
    host, port = parse_host_port(addr, "LORAFLEET_GATEWAY_ADDR")
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets whose proto
    # says TCP, and an accepted socket inherits proto 0 from socket.socket()'s
    # default; without it every answer waits out a delayed ACK (~40 ms).
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host or "0.0.0.0", port))
    except OSError as e:
        sock.close()
        raise SettingsError(
            f"LORAFLEET_GATEWAY_ADDR={addr}: cannot listen there ({e.strerror}): "
            "pick a free port, or port 0 for any"
        ) from None
    sock.listen(1024)
    sock.setblocking(False)
    return sock


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: `runtime.serve` owns SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class Gateway:
    def __init__(self, nc: Nats, settings: Settings, config: GatewayConfig) -> None:
        self.settings = settings
        self.config = config
        self.client = Client(nc, settings)
        self.http = httpx2.AsyncClient(limits=httpx2.Limits(max_keepalive_connections=64))
        # Processes that check uploads' records beside their put (a thread
        # would hold the GIL the put needs).
        self.checker = CheckWorkers(CHECK_WORKERS)
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None
        self._scraper: asyncio.Task[None] | None = None
        self._node_watch: KeyWatch | None = None
        self.url = ""

    async def start(self) -> None:
        bucket = self.settings.names.gateway_bucket
        state = await when_cluster_answers(
            "the gateway's bucket", lambda: GatewayState.open(self.client.js, bucket)
        )
        ttl_s, key = self.config.engine_models_ttl_s, self.config.engine_api_key
        fleet = FleetModelLocator(self.client, key, ttl_s)
        locator: ModelLocator = fleet
        self._node_watch = KeyWatch(
            self.client.js, self.settings.names.nodes_bucket, ">",
            lambda entry: _node_entry(fleet, entry), log.get(),
        )  # fmt: skip
        self._node_watch.start()
        if self.config.engines:
            configured = [ModelLocation(url.rstrip("/"), key) for url in self.config.engines]
            locator = ConfiguredFirstLocator(EngineModels(configured, self.http, ttl_s), locator)
        ctx = GatewayContext(self.config, self.client, state, locator, self.http, self.checker)
        self._scraper = asyncio.create_task(_scrape_loads(ctx.loads, self.http))
        # Started now, so that the first upload does not wait for their imports.
        for _ in range(CHECK_WORKERS):
            self.checker.submit(check_lines, b"", 1)
        keys = KeyRing(self.config.keys_file(self.settings.data_dir))
        sock = _bind(self.config.addr)
        server = _Server(
            uvicorn.Config(
                make_app(ctx, keys), log_config=None,
                access_log=False, lifespan="off", timeout_graceful_shutdown=IN_FLIGHT_GRACE_S,
            )
        )  # fmt: skip
        self._server = server
        self._task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            if self._task.done():
                self._task.result()
                raise RuntimeError("the gateway's HTTP server stopped before it started")
            await asyncio.sleep(STARTED_POLL_S)
        host, port = sock.getsockname()[:2]
        self.url = f"http://{host}:{port}"
        log.get().info(log.Event.GATEWAY_LISTENING, url=self.url, engines=list(self.config.engines))

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                await self._task
        await stop_tasks(self._scraper)
        if self._node_watch is not None:
            await self._node_watch.stop()
        await self.http.aclose()
        self.checker.shutdown(wait=False, cancel_futures=True)


def _node_entry(fleet: FleetModelLocator, entry: KeyValue.Entry | None) -> None:
    """A heartbeat key's change: a departure takes the node out of the routes at once."""
    if entry is None:
        return
    if removed(entry.operation):
        fleet.node_gone(entry.key)
        log.get().info(log.Event.GATEWAY_NODE_GONE, node=entry.key)
    else:
        fleet.node_beat(entry.key)


async def _scrape_loads(loads: Loads, http: httpx2.AsyncClient) -> None:
    """The engines' own counts of requests, read every METRICS_EVERY_S (replica_choice.py)."""
    while True:
        await asyncio.sleep(METRICS_EVERY_S)
        with contextlib.suppress(Exception):  # one bad read must not end the loop
            await loads.scrape(http, list(loads.own))


def program(config: GatewayConfig) -> runtime.Program:
    """The gateway with `config` as a process (`runtime.main(program(config))`);
    the config is read before, so that a bad setting stops it before it connects."""

    async def make(nc: Nats, settings: Settings) -> Gateway:
        return Gateway(nc, settings, config)

    return runtime.Program("gateway", make)


def main() -> None:
    """`lorafleet gateway`: LORAFLEET_* and LORAFLEET_GATEWAY_* from the environment."""
    runtime.main(program(runtime.read_or_exit("gateway", GatewayConfig.from_env)))
