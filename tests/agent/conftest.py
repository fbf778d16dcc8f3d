"""The agent's tests: a real nats-server, a real agent process with the stand-in
trainer, driven directly over NATS (no scheduler)."""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext

from lorafleet.nats import _bus as bus
from lorafleet.settings import Settings
from lorafleet_schemas.messages import (
    ArtifactKind,
    CheckpointRef,
    Engine,
    JobState,
    ModelRecord,
    StartReply,
    StartRequest,
    StatusReport,
    TrainerParams,
)
from tests.eventually import eventually
from tests.procs import ServiceProcess, agent_process

DATA = b"".join(
    msgspec.json.encode({"q": f"what is {i}+{i}?", "a": str(2 * i)}) + b"\n" for i in range(20)
)
DATA_SHA = hashlib.sha256(DATA).hexdigest()


@dataclass
class Bus:
    settings: Settings
    nc: Client
    js: JetStreamContext
    tmp_path: Path
    agents: list[ServiceProcess] = field(default_factory=list)

    async def upload(self, data: bytes = DATA, name: str | None = None) -> tuple[str, str]:
        sha = hashlib.sha256(data).hexdigest()
        name = name or f"sha256/{sha}"
        store = await self.js.object_store(self.settings.names.datasets_bucket)
        await store.put(name, data)
        return name, sha

    async def agent(
        self, node: str = "node-1", env: Mapping[str, str] | None = None, **cfg: Any
    ) -> ServiceProcess:
        proc = agent_process(self.settings, self.tmp_path, node, env, **cfg)
        self.agents.append(proc)
        return await proc.start()

    async def start(self, req: StartRequest, node: str = "node-1") -> StartReply:
        return await bus.request(
            self.nc, self.settings.names.node_start(node), req, StartReply, timeout_s=5
        )

    async def reports(self, node: str, job_id: str) -> Reports:
        sub = await self.js.subscribe(
            self.settings.names.status(node, job_id), ordered_consumer=True
        )
        return Reports(sub)


class Reports:
    """The status reports of one job, read from the status stream in order."""

    def __init__(self, sub: Any) -> None:
        self.sub = sub
        self.items: list[StatusReport] = []

    async def until(
        self, pred: Any, timeout_s: float = 30.0, what: str = "a report"
    ) -> StatusReport:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        for r in self.items:
            if pred(r):
                return r
        while True:
            left = deadline - loop.time()
            if left <= 0:
                raise AssertionError(f"never saw {what}; got {self.summary()}")
            try:
                msg = await self.sub.next_msg(timeout=left)
            except nats.errors.TimeoutError:
                continue
            r = msgspec.json.decode(msg.data, type=StatusReport, strict=True)
            self.items.append(r)
            if pred(r):
                return r

    async def until_state(self, *states: JobState, timeout_s: float = 30.0) -> StatusReport:
        return await self.until(lambda r: r.state in states, timeout_s, f"state {states}")

    def states(self) -> list[JobState]:
        return [r.state for r in self.items if r.state is not None]

    def summary(self) -> list[str]:
        return [f"{r.seq}:{r.state}:{r.step}:{r.message}" for r in self.items]


async def finished(agent: ServiceProcess, job_id: str, timeout_s: float = 15.0) -> None:
    """Wait until the agent has let go of `job_id` (its final report comes a
    moment before: the agent is busy until the job's directory is cleaned)."""
    await eventually(
        lambda: any(e.get("job_id") == job_id for e in agent.events("job.finished")),
        f"{job_id} to finish (job.finished)",
        timeout_s=timeout_s,
        interval_s=0.02,
    )


def start_request(
    job_id: str,
    dataset: str,
    sha: str,
    *,
    attempt: int = 1,
    gpu_memory_mib: int = 1000,
    artifacts: list[ArtifactKind] | None = None,
    params: TrainerParams | None = None,
    resume: CheckpointRef | None = None,
) -> StartRequest:
    return StartRequest(
        job_id=job_id,
        attempt=attempt,
        model=ModelRecord(
            name="tiny",
            engine=Engine.VLLM,
            hf_repo=None,
            hf_revision="main",
            local_dir="/models/tiny",
            description="",
            created_at=dt.datetime.now(dt.UTC),
        ),
        gpu_memory_mib=gpu_memory_mib,
        dataset=dataset,
        dataset_sha256=sha,
        params=params or TrainerParams(),
        artifacts=artifacts if artifacts is not None else [ArtifactKind.PEFT],
        resume=resume,
    )


@pytest.fixture
async def fleet(settings: Settings, tmp_path: Path) -> AsyncIterator[Bus]:
    nc = await bus.connect(settings, "agent-test")
    js = nc.jetstream()
    await bus.ensure_layout(js, bus.layout_for(settings))
    b = Bus(settings, nc, js, tmp_path)
    try:
        yield b
    finally:
        for a in b.agents:
            await a.stop()
        # close, not drain: a drain would wait for unread reports.
        await nc.close()
