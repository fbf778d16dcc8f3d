"""Served wherever its model is served: agents each beside an engine, a
job's serving policy placed across them by the scheduler, and cordon,
drain, uncordon. Real processes throughout (nats-server, PostgreSQL, the
recorder, the scheduler, the artifact-store, agents with the stand-in
trainer); the engines are tests/gateway/engine.py, a process with vLLM's
interface that the agents' process scan takes for vLLM (no GPU here, and
one CPU vLLM per node would not fit this machine): each load runs the
agent's real preflight, fetch from the store, load and probe."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2
import pytest

from lorafleet.fleet_serving import served_adapter_name
from lorafleet_schemas.messages import JobRecord, JobState, NodeSchedule
from lorafleet_services.gateway.api_keys import make_key
from tests.eventually import eventually
from tests.gateway.conftest import gateway_on
from tests.gateway.engine import engine_argv
from tests.ports import free_port
from tests.procs import ServiceProcess
from tests.system.conftest import Stack, kill_agent

#: Seconds a placement may take to show on an engine: a scheduler round,
#: the agent's fetch, load and probe, the engine watch's next read.
PLACED_TIMEOUT_S = 40.0
#: Seconds a node with nothing to get is watched for a load that must not come:
#: several of the leader's placement passes (one a second) and engine reads.
QUIET_S = 4.0


@dataclass
class Engine:
    """One stand-in engine process on its port."""

    proc: asyncio.subprocess.Process
    url: str

    async def answered(self) -> int:
        """Completions it began answering (its vllm:request_success_total)."""
        async with httpx2.AsyncClient() as http:
            text = (await http.get(f"{self.url}/metrics", timeout=5.0)).text
        line = next(x for x in text.splitlines() if x.startswith("vllm:request_success_total"))
        return int(float(line.split()[-1]))

    async def adapters(self) -> list[str]:
        async with httpx2.AsyncClient() as http:
            reply = await http.get(f"{self.url}/v1/models", timeout=5.0)
        return [m["id"] for m in reply.json()["data"] if m.get("parent")]

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()


@dataclass
class Fleet:
    """The stack, its catalog model served by engines of that base, and a node per engine."""

    stack: Stack
    base: Path
    engines: dict[str, Engine] = field(default_factory=dict)

    async def node(self, name: str) -> ServiceProcess:
        """An engine of the base, then an agent beside it that knows it."""
        port = free_port()
        env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}
        proc = await asyncio.create_subprocess_exec(
            *engine_argv(str(self.base), port), env=env, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        assert line.startswith(b"listening"), line
        engine = Engine(proc, f"http://127.0.0.1:{port}")
        self.engines[name] = engine
        return await self.stack.agent(name, vllm_servers=(engine.url,), engines_refresh_s=0.5)

    async def done(self, serving: Any = None, node: str | None = "node-1") -> JobRecord:
        extra = {} if serving is None else {"serving": serving}
        job = await self.stack.submit(node=node, **extra)
        return await self.stack.wait_state(job.id, JobState.DONE, JobState.FAILED)

    async def holding(self, name: str) -> set[str]:
        """The nodes whose engine lists `name` now (a dead engine lists nothing)."""
        out = set()
        for node, engine in self.engines.items():
            with contextlib.suppress(httpx2.HTTPError):
                if name in await engine.adapters():
                    out.add(node)
        return out

    async def wait_holding(self, name: str, nodes: set[str]) -> None:
        await eventually(
            lambda: self.holding(name), f"{name} on exactly {sorted(nodes)}",
            until=lambda held: held == nodes, timeout_s=PLACED_TIMEOUT_S,
        )  # fmt: skip

    async def schedule(self, node: str, schedule: NodeSchedule) -> dict[str, Any]:
        body = {"node": node, "schedule": schedule.value}
        reply: dict[str, Any] = await self.stack.call(
            self.stack.settings.names.nodes_schedule, body
        )
        return reply

    async def engine_listed(self, node: str) -> None:
        """Until the scheduler's node table shows `node`'s engine in its heartbeat."""

        async def listed() -> bool:
            nodes = (await self.stack.nodes()).nodes
            return any(n.heartbeat.node == node and n.heartbeat.serving for n in nodes)

        await eventually(listed, f"{node}'s engine in its heartbeat", until=bool)


@pytest.fixture
async def fleet(stack: Stack, tmp_path: Path) -> AsyncIterator[Fleet]:
    await stack.add_model("tiny")
    out = Fleet(stack, tmp_path / "models" / "tiny")
    try:
        yield out
    finally:
        for engine in out.engines.values():
            await engine.stop()


def served_name(job: JobRecord) -> str:
    assert job.state is JobState.DONE and job.adapter is not None, job
    return served_adapter_name(job.id, job.adapter.sha256)


async def test_all_reaches_every_node_and_a_node_that_comes_later(fleet: Fleet) -> None:
    for node in ("node-1", "node-2", "node-3"):
        await fleet.node(node)
    job = await fleet.done(serving="all")
    name = served_name(job)
    await fleet.wait_holding(name, {"node-1", "node-2", "node-3"})
    # An engine (and its node) that comes later gets what is desired there.
    await fleet.node("node-4")
    await fleet.wait_holding(name, {"node-1", "node-2", "node-3", "node-4"})

    async def served_on() -> set[str]:
        records = await fleet.stack.call(
            fleet.stack.settings.names.adapters_list, {"job_id": job.id, "limit": 100}
        )
        return {r["node"] for r in records["adapters"] if r["state"] == "served"}

    # The engine lists it once loaded; the record says served after the probe.
    await eventually(served_on, "node-4's record served", until=lambda nodes: "node-4" in nodes)


async def test_replicas_stay_put_when_a_node_joins_and_move_when_one_dies(fleet: Fleet) -> None:
    agents = {n: await fleet.node(n) for n in ("node-1", "node-2")}
    name = served_name(await fleet.done(serving={"replicas": 2}))
    await fleet.wait_holding(name, {"node-1", "node-2"})
    await fleet.node("node-3")
    await fleet.engine_listed("node-3")
    await asyncio.sleep(QUIET_S)  # nothing may move to the newcomer meanwhile
    assert await fleet.holding(name) == {"node-1", "node-2"}
    # node-1 dies, engine and all: its replica is placed on node-3.
    kill_agent(agents["node-1"])
    await fleet.engines["node-1"].stop()
    await fleet.wait_holding(name, {"node-2", "node-3"})


async def test_cordon_drain_and_uncordon(fleet: Fleet) -> None:
    for node in ("node-1", "node-2"):
        await fleet.node(node)
    name = served_name(await fleet.done(serving={"replicas": 1}, node=None))
    [first] = await eventually(lambda: fleet.holding(name), "one replica", until=bool)
    other = "node-2" if first == "node-1" else "node-1"
    # Cordoned: no new training there, serving untouched.
    marked = await fleet.schedule(first, NodeSchedule.CORDONED)
    assert marked["schedule"] == "cordoned" and marked["alive"], marked
    for _ in range(3):
        assert (await fleet.done(node=None)).node == other
    await fleet.schedule(other, NodeSchedule.CORDONED)
    waiting = await fleet.stack.submit(node=None)
    await eventually(
        lambda: fleet.stack.get(waiting.id), "a queued job saying every node is cordoned",
        until=lambda job: "cordoned" in job.message,
    )  # fmt: skip
    await fleet.schedule(other, NodeSchedule.OPEN)
    await fleet.stack.wait_state(waiting.id, JobState.DONE)
    assert await fleet.holding(name) == {first}
    # Drained: placed elsewhere first, then unloaded there.
    await fleet.schedule(first, NodeSchedule.DRAINED)
    await fleet.wait_holding(name, {other})
    nodes = {n.heartbeat.node: n.schedule for n in (await fleet.stack.nodes()).nodes}
    assert nodes == {first: NodeSchedule.DRAINED, other: NodeSchedule.OPEN}
    # Uncordoned: open again, training goes there (the other one cordoned now).
    await fleet.schedule(first, NodeSchedule.OPEN)
    await fleet.schedule(other, NodeSchedule.CORDONED)
    assert (await fleet.done(node=None)).node == first


async def test_the_gateway_routes_by_load_retries_and_drops_a_lost_node(fleet: Fleet) -> None:
    """The base through the gateway: the replica with the fewest requests in
    flight; an engine that refuses the connection is retried on another
    within the request; a node whose heartbeat expired is out of the routes
    at once, though the gateway's view (TTL 600 s here) is never renewed."""
    agents = {n: await fleet.node(n) for n in ("node-1", "node-2", "node-3")}
    for node in agents:
        await fleet.engine_listed(node)
    keys_file = fleet.stack.tmp_path / "keys.json"
    key = make_key(keys_file, "alice")
    more = {"LORAFLEET_GATEWAY_ENGINE_MODELS_TTL_S": "600"}
    async with (
        gateway_on(fleet.stack, keys_file, more) as (gateway, url),
        httpx2.AsyncClient(
            base_url=f"{url}/v1", headers={"authorization": f"Bearer {key}"}, timeout=30.0
        ) as http,
    ):

        async def chat(words: str = "hello there", stream: bool = False) -> httpx2.Response:
            body = {"model": "tiny", "stream": stream,
                    "messages": [{"role": "user", "content": words}]}  # fmt: skip
            return await http.post("/chat/completions", json=body)

        async def counts() -> dict[str, int]:
            live = {n: e for n, e in fleet.engines.items() if e.proc.returncode is None}
            return {n: await e.answered() for n, e in live.items()}

        assert (await chat()).status_code == 200
        # One slow stream in flight: the quick ones go to the other two.
        first = await counts()
        slow = asyncio.create_task(chat("answer very slowly", True))
        begun = sum(first.values()) + 1
        busy = await eventually(counts, "the slow stream begun",
                                until=lambda c: sum(c.values()) == begun)  # fmt: skip
        [slow_node] = [n for n in busy if busy[n] > first[n]]
        before = await counts()
        for _ in range(6):
            assert (await chat()).status_code == 200
        after = await counts()
        assert not slow.done()
        grown = {n for n in after if after[n] > before[n]}
        assert len(grown) == 2 and len(grown | {slow_node}) == 3, (before, after, slow_node)
        assert (await slow).status_code == 200
        # node-3's engine refuses connections; its node still lists it.
        await fleet.engines["node-3"].stop()
        for _ in range(6):
            assert (await chat()).status_code == 200
        assert gateway.events("gateway.retried"), "node-3 was never tried first"
        # node-2's agent dies (its engine runs on): out at its heartbeat's expiry.
        kill_agent(agents["node-2"])
        await gateway.wait_for_event("gateway.node_gone")
        before = await counts()
        for _ in range(6):
            assert (await chat()).status_code == 200
        assert (await counts())["node-2"] == before["node-2"]
