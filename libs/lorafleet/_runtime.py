"""How a lorafleet service process runs, written once: `serve()`.

Each service describes itself as a `Program`; its `__main__` calls
`runtime.main(PROGRAM)`, which reads `Settings`, configures logging and runs
`serve()` until SIGTERM or SIGINT. `serve()` serves metrics, runs
`before_connect` (the recorder's migration, the agent's leftovers), connects,
ensures the JetStream layout (`"ensure"`, waiting for a cluster between leaders:
`bus.when_cluster_answers`, as every JetStream step of a start does; or
`"if_allowed"`: a node's credentials may not create streams), starts the
service (`service.started`), and on the stop signal stops it and drains
(`service.stopped`). A service needs only `start()`/`stop()` (`Service`);
`reconnected()` (`Reconnects`) is called after each reconnect. Exit codes:
`EXIT_SETTINGS`, `EXIT_CONNECT` (also a cluster that did not answer a start's
JetStream step in time), a traceback (1) otherwise. Tests and the
embedded stack call `serve(program, settings, stop=event)` in-process.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NoReturn, Protocol, TypeVar, runtime_checkable

from nats.aio.client import Client
from nats.js import JetStreamContext

import lorafleet
import lorafleet.log as log
import lorafleet.metrics as metrics
import lorafleet.nats._bus as bus
from lorafleet._metrics_http import MetricsServer
from lorafleet._tasks import stop_tasks
from lorafleet.access.permissions import owned_layout_parts
from lorafleet.errors import ConnectError
from lorafleet.exits import Exit
from lorafleet.log import Event
from lorafleet.settings import Settings, SettingsError

T = TypeVar("T")

#: Exit codes from the one table (lorafleet/exits.py), for a process run as
#: `python -m` as for the same service run as a `lorafleet` command.
EXIT_SETTINGS = Exit.USAGE
EXIT_CONNECT = Exit.UNREACHABLE
#: Seconds a service keeps asking for its layout at start (the one wait of
#: every start's JetStream steps, `bus.when_cluster_answers`).
LAYOUT_RETRY_S = bus.CLUSTER_WAIT_S


class Service(Protocol):
    """What `serve()` runs: started once, stopped once.

    `stop()` is called even when `start()` failed halfway: it must cope
    with what was not started.
    """

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


@runtime_checkable
class Reconnects(Protocol):
    """A service that wants to know when its connection is back (not async)."""

    def reconnected(self) -> None: ...


MakeService = Callable[[Client, Settings], Awaitable[Service]]


@dataclass(frozen=True, slots=True)
class Program:
    """One service process, as `serve()` needs to know it.

    name: the service's name in logs and messages ("recorder", "agent", ...).
    make: builds the service object on the connected client (not started yet).
    layout: "ensure" (default) or "if_allowed" (see the module docstring).
    before_connect: async work before connecting; default none.
    client_name: the NATS connection's name; default "lorafleet-<name>".
    started_fields: extra fields on the `service.started` line; default none.
    """

    name: str
    make: MakeService
    layout: Literal["ensure", "if_allowed"] = "ensure"
    before_connect: Callable[[Settings], Awaitable[None]] | None = None
    client_name: str = ""
    started_fields: Mapping[str, Any] = field(default_factory=dict)


def stop_on_signals(*signals: signal.Signals) -> asyncio.Event:
    """An event that any of `signals` sets (their handlers, from now on)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    return stop


async def serve(program: Program, settings: Settings, stop: asyncio.Event | None = None) -> None:
    """Run `program` until `stop` is set (default: until SIGTERM or SIGINT)."""
    if stop is None:
        stop = stop_on_signals(signal.SIGTERM, signal.SIGINT)
    metrics_server = await start_metrics(program, settings)
    try:
        await _serve(program, settings, stop, metrics_server)
    finally:
        if metrics_server is not None:
            await metrics_server.stop()


async def start_metrics(program: Program, settings: Settings) -> MetricsServer | None:
    """The metrics endpoint, when `settings.metrics_addr` is set (bound before
    anything else, so that a port in use stops the process at once)."""
    metrics.register(program.name)
    metrics.BUILD_INFO.labels(program.name, lorafleet.__version__).set(1)
    if not settings.metrics_addr:
        return None
    server = MetricsServer(settings.metrics_addr)
    await server.start()
    return server


async def _serve(
    program: Program,
    settings: Settings,
    stop: asyncio.Event,
    metrics_server: MetricsServer | None,
) -> None:
    logger = log.get()
    if program.before_connect is not None and not await _unless_stopped(
        program.before_connect(settings), stop
    ):
        logger.info(Event.SERVICE_STOPPED)
        return
    layout_refusal = LayoutRefusal()
    holder: list[Service] = []

    async def reconnected_cb() -> None:
        logger.info(Event.NATS_RECONNECTED)
        if holder and isinstance(holder[0], Reconnects):
            holder[0].reconnected()

    nc = await bus.connect(
        settings,
        program.client_name or f"lorafleet-{program.name}",
        on_refused=layout_refusal.heard,
        reconnected_cb=reconnected_cb,
    )
    try:
        if program.layout == "ensure":
            await _ensure_owned_layout(nc, settings, program.name)
        else:
            await ensure_layout_if_allowed(nc, settings, layout_refusal)
        service = await program.make(nc, settings)
        holder.append(service)
        try:
            await service.start()
            logger.info(
                Event.SERVICE_STARTED,
                version=lorafleet.__version__,
                **({"metrics": metrics_server.url} if metrics_server is not None else {}),
                **program.started_fields,
            )
            await stop.wait()
        finally:
            await service.stop()
    finally:
        await bus.drain_quietly(nc)
        logger.info(Event.SERVICE_STOPPED)


async def _unless_stopped(work: Awaitable[None], stop: asyncio.Event) -> bool:
    """Run `work` unless `stop` is set first (then it is cancelled): whether it
    ran. A recorder waiting for its database stops when told to."""
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if not task.done():
        await stop_tasks(task)
        return False
    task.result()
    return True


async def _ensure_owned_layout(nc: Client, settings: Settings, name: str) -> None:
    """The parts of the layout this service owns, tried for LAYOUT_RETRY_S."""
    await ensure_layout_retrying(
        nc.jetstream(), settings, owned_layout_parts(settings.nats_nkey_seed, name)
    )


async def ensure_layout_retrying(
    js: JetStreamContext, settings: Settings, parts: tuple[str, ...] | None = None
) -> None:
    """`bus.ensure_layout`, while the cluster settles (`bus.when_cluster_answers`):
    a cluster that has just become ready can time out a replicated stream's
    creation while it places the stream's group or has a member not yet
    connected ("no suitable peers for placement"), and a server still
    catching up answers "temporarily unavailable"."""
    await bus.when_cluster_answers(
        "the JetStream layout", lambda: bus.ensure_layout(js, bus.layout_for(settings), parts)
    )


class LayoutRefusal:
    """The connection's `on_refused` while a node tries to create the layout:
    the refusal its credentials get there is expected, so it is claimed (the
    connection logs no warning) and `ensure_layout_if_allowed` logs it once,
    at info. Refusals outside the attempt are the connection's to warn of."""

    def __init__(self) -> None:
        self.expected = False
        #: The server's words, once a refusal was heard during the attempt.
        self.words: str | None = None
        self.event = asyncio.Event()

    def heard(self, words: str) -> bool:
        if not self.expected:
            return False
        self.words = self.words or words
        self.event.set()
        return True


async def ensure_layout_if_allowed(nc: Client, settings: Settings, refusal: LayoutRefusal) -> None:
    """Create the JetStream layout, unless these credentials may not.

    A node's credentials (lorafleet.access.permissions) do not allow creating
    streams: the services create them. A refused request is not answered,
    so the refusal (heard by `refusal`, the connection's `on_refused`) ends
    the attempt at once instead of a request timeout later.
    """
    logger = log.get()
    refusal.expected, refusal.words = True, None
    refusal.event.clear()
    task = asyncio.ensure_future(bus.ensure_layout(nc.jetstream(), bus.layout_for(settings)))
    waiter = asyncio.ensure_future(refusal.event.wait())
    try:
        done, _ = await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        refusal.expected = False
    if task not in done:
        await stop_tasks(task)
        logger.info(
            Event.NATS_REFUSED,
            message="this node's credentials may not create the JetStream layout; "
            "the services create it",
            error=refusal.words,
        )
        return
    try:
        task.result()
    except Exception as e:
        logger.warning(Event.NATS_ERROR, error=repr(e), message="could not ensure the layout")


def exit_with(name: str, error: BaseException, code: int) -> NoReturn:
    """One line on stderr (`lorafleet <name>: <error>`), then exit `code`."""
    print(f"lorafleet {name}: {error}", file=sys.stderr)
    sys.exit(code)


def read_or_exit(name: str, read: Callable[[], T]) -> T:
    """`read()` (a settings reader), or exit 2 with its one line on a bad setting.

    For settings a program needs before `main` (the agent's AgentConfig).
    """
    try:
        return read()
    except SettingsError as e:
        exit_with(name, e, EXIT_SETTINGS)


def main(program: Program, settings: Settings | None = None) -> None:
    """Run `program` as this process (see the module docstring for exit codes)."""
    settings = settings or read_or_exit(program.name, Settings.from_env)
    log.configure(program.name, settings.log_level)
    try:
        asyncio.run(serve(program, settings))
    except SettingsError as e:
        exit_with(program.name, e, EXIT_SETTINGS)
    except ConnectError as e:
        exit_with(program.name, e, EXIT_CONNECT)
