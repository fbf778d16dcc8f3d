"""The whole system on a server with lorafleet's users: the services log in as
the service user, the agent as node-1 (its own subjects only). A job runs to
`done` with the stand-in trainer, another is cancelled while it trains, and
nothing is refused on the way but the agent's attempt to create the layout."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats.js.errors
import pytest
from nats.aio.client import Client

from lorafleet.errors import raise_for_error
from lorafleet.log import Event
from lorafleet.nats import _bus as bus
from lorafleet_services.agent.config import AgentConfig
from tests.eventually import eventually
from tests.permissions.conftest import Fleet
from tests.procs import ServiceProcess

DATA = "".join(json.dumps({"q": f"what is {i}+{i}?", "a": str(2 * i)}) + "\n" for i in range(20))
FINAL = ("done", "failed", "cancelled")
#: Seconds a job has to reach a state (the stand-in trainer is fast).
STATE_TIMEOUT_S = 30.0
#: Seconds between two jobs.get while waiting.
STATE_INTERVAL_S = 0.1


@dataclass
class System:
    fleet: Fleet
    nc: Client
    tmp_path: Path
    services: list[ServiceProcess] = field(default_factory=list)
    agent: ServiceProcess | None = None

    async def start_agent(self, env: Mapping[str, str] | None = None) -> ServiceProcess:
        cfg = AgentConfig(
            node="node-1",
            work_dir=self.tmp_path / "agent-node-1",
            engines_dir=self.tmp_path / "engines",
            trainer="standin",
            allow_cpu=True,
            cancel_grace_s=1.0,
        )
        self.agent = ServiceProcess(
            "lorafleet_services.agent",
            self.fleet.node_settings("node-1"),
            env={**cfg.to_env(), **(env or {})},
        )
        return await self.agent.start()

    async def call(self, subject: str, body: dict[str, Any]) -> Any:
        msg = await self.nc.request(subject, json.dumps(body).encode(), timeout=10)
        raise_for_error(msg.data, msg.headers)
        return json.loads(msg.data)

    async def submit(self) -> dict[str, Any]:
        names = self.fleet.base.names
        base = self.tmp_path / "models" / "tiny"
        if not base.exists():
            base.mkdir(parents=True)
            await self.call(
                names.models_add, {"name": "tiny", "engine": "vllm", "local_dir": str(base)}
            )
        body = {"model": "tiny", "gpu_memory_mib": 1000, "data": DATA, "node": "node-1"}
        job: dict[str, Any] = await self.call(names.jobs_submit, body)
        return job

    async def wait(
        self, job_id: str, *states: str, timeout_s: float = STATE_TIMEOUT_S
    ) -> dict[str, Any]:
        """The job once it is in one of `states` or final (the test then says which)."""
        job: dict[str, Any] = await eventually(
            lambda: self.call(self.fleet.base.names.jobs_get, {"id": job_id}),
            f"job {job_id} to reach {states} or end",
            until=lambda j: j["state"] in states or j["state"] in FINAL,
            timeout_s=timeout_s,
            interval_s=STATE_INTERVAL_S,
        )
        return job

    def assert_nothing_refused(self) -> None:
        """The agent's layout attempt was refused at once (it said so, in one
        line with the server's words); nothing else was."""
        assert self.agent is not None
        said = self.agent.events(Event.NATS_REFUSED)
        assert [ln["level"] for ln in said] == ["info"], said
        assert "$js.api.stream.create" in said[0]["error"]
        for proc in self.services:
            assert proc.events(Event.NATS_REFUSED) == [], proc.module


@pytest.fixture
async def system(fleet: Fleet, sqlite_url: str, tmp_path: Path) -> AsyncIterator[System]:
    """Recorder, artifact-store and scheduler as the service user; the agent is
    started by the test (`await system.start_agent()`)."""
    svc = fleet.service_settings().with_(database_url=sqlite_url)
    nc = await bus.connect(svc, "test-client")
    s = System(fleet, nc, tmp_path)
    try:
        for module in ("recorder", "artifact_store", "scheduler"):
            proc = ServiceProcess(f"lorafleet_services.{module}", svc)
            s.services.append(proc)
            await proc.start()
        yield s
    finally:
        for proc in [*([s.agent] if s.agent else []), *reversed(s.services)]:
            with contextlib.suppress(Exception):
                await proc.stop(timeout_s=5)
        await bus.drain_quietly(nc)


async def test_a_job_ends_done_with_the_agent_on_node_1_credentials(system: System) -> None:
    names = system.fleet.base.names
    agent = await system.start_agent()
    job = await system.submit()
    job = await system.wait(job["id"], "done")
    assert job["state"] == "done", job
    listed = await system.call(names.artifacts_list, {"job_id": job["id"]})
    assert {a["kind"] for a in listed["artifacts"]} >= {"peft"}
    system.assert_nothing_refused()

    # A clean stop deletes node-1's heartbeat (the KV delete as a plain publish).
    await agent.stop()
    kv = await system.nc.jetstream().key_value(names.nodes_bucket)
    with pytest.raises((nats.js.errors.KeyDeletedError, nats.js.errors.KeyNotFoundError)):
        await kv.get("node-1")
    system.assert_nothing_refused()


async def test_a_job_is_cancelled_on_node_1_credentials(system: System) -> None:
    await system.start_agent({"LORAFLEET_STANDIN_STEPS": "200", "LORAFLEET_STANDIN_STEP_S": "0.1"})
    job = await system.submit()
    job = await system.wait(job["id"], "running")
    assert job["state"] == "running", job
    await system.call(system.fleet.base.names.jobs_cancel, {"id": job["id"], "reason": "test"})
    job = await system.wait(job["id"], "cancelled")
    assert job["state"] == "cancelled", job
    assert system.agent is not None
    await system.agent.wait_for_event(Event.JOB_FINISHED, timeout_s=10)
    # The agent got the scheduler's cancel on node-1's subject and stopped the trainer.
    assert [ln["state"] for ln in system.agent.events(Event.JOB_CANCELLED)] == ["cancelled"]
    system.assert_nothing_refused()
