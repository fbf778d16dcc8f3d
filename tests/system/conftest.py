"""System tests: recorder, scheduler, artifact-store and agents as real processes
on a real nats-server and a real PostgreSQL, driven with raw JSON over NATS
(what any NATS client, the `nats` CLI included, would send)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import importlib.util
import json
import os
import signal
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import psutil
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext

from lorafleet import _runtime as runtime
from lorafleet.errors import raise_for_error
from lorafleet.nats import _bus as bus
from lorafleet.nats.server import NatsServer
from lorafleet.settings import Settings
from lorafleet.states import ON_NODE
from lorafleet_schemas.messages import (
    Card,
    Heartbeat,
    JobCurve,
    JobList,
    JobRecord,
    JobState,
    NodeList,
)
from tests.eventually import eventually
from tests.procs import ServiceProcess, agent_process

DATA = "".join(json.dumps({"q": f"what is {i}+{i}?", "a": str(2 * i)}) + "\n" for i in range(20))

#: Seconds a job may take to reach a state in these tests (the stand-in is fast).
STATE_TIMEOUT_S = 30.0


def has_artifact_store() -> bool:
    return importlib.util.find_spec("lorafleet_services.artifact_store.__main__") is not None


def pid_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


@dataclass
class Stack:
    """The running system and a client connection to it."""

    settings: Settings
    nats_server: NatsServer
    nc: Client
    js: JetStreamContext
    tmp_path: Path
    recorder: ServiceProcess
    schedulers: list[ServiceProcess] = field(default_factory=list)
    agents: dict[str, ServiceProcess] = field(default_factory=dict)
    artifact_store: ServiceProcess | None = None
    procs: list[ServiceProcess] = field(default_factory=list)

    # --- processes ------------------------------------------------------

    async def scheduler(self, nats_url: str | None = None) -> ServiceProcess:
        """One more scheduler; `nats_url` connects it elsewhere than the stack's URL."""
        settings = self.settings.with_(nats_url=nats_url) if nats_url else self.settings
        proc = ServiceProcess("lorafleet_services.scheduler", settings)
        self.schedulers.append(proc)
        self.procs.append(proc)
        return await proc.start()

    async def recorder_replica(self) -> ServiceProcess:
        """One more recorder on the stack's settings: it shares the API queue
        group and the status consumer with `recorder`."""
        proc = ServiceProcess("lorafleet_services.recorder", self.settings)
        self.procs.append(proc)
        return await proc.start()

    async def agent(
        self,
        node: str = "node-1",
        env: Mapping[str, str] | None = None,
        nats_url: str | None = None,
        **cfg: Any,
    ) -> ServiceProcess:
        """An agent; `nats_url` connects it elsewhere than the stack's URL (one member)."""
        settings = self.settings.with_(nats_url=nats_url) if nats_url else self.settings
        proc = agent_process(settings, self.tmp_path, node, env, **cfg)
        self.agents[node] = proc
        self.procs.append(proc)
        return await proc.start()

    # --- raw JSON requests ----------------------------------------------

    async def call(self, subject: str, body: dict[str, Any], timeout_s: float = 10.0) -> Any:
        """Send `body` as JSON; return the decoded JSON reply (raise on an error reply)."""
        msg = await self.nc.request(subject, json.dumps(body).encode(), timeout=timeout_s)
        raise_for_error(msg.data, msg.headers)
        return json.loads(msg.data)

    async def add_model(self, name: str = "tiny") -> None:
        base = self.tmp_path / "models" / name
        base.mkdir(parents=True, exist_ok=True)
        await self.call(
            self.settings.names.models_add,
            {"name": name, "engine": "vllm", "local_dir": str(base)},
        )

    async def submit(
        self, node: str | None = "node-1", mib: int = 1000, model: str = "tiny", **extra: Any
    ) -> JobRecord:
        body: dict[str, Any] = {"model": model, "gpu_memory_mib": mib, "data": DATA, **extra}
        if node is not None:
            body["node"] = node
        reply = await self.call(self.settings.names.jobs_submit, body)
        return msgspec.convert(reply, JobRecord)

    async def get(self, job_id: str) -> JobRecord:
        return msgspec.convert(
            await self.call(self.settings.names.jobs_get, {"id": job_id}), JobRecord
        )

    async def cancel(self, job_id: str, reason: str = "") -> JobRecord:
        return msgspec.convert(
            await self.call(self.settings.names.jobs_cancel, {"id": job_id, "reason": reason}),
            JobRecord,
        )

    async def curve(self, job_id: str) -> JobCurve:
        return msgspec.convert(
            await self.call(self.settings.names.jobs_curve, {"id": job_id}), JobCurve
        )

    async def nodes(self) -> NodeList:
        return msgspec.convert(await self.call(self.settings.names.nodes_list, {}), NodeList)

    async def active_jobs(self) -> list[JobRecord]:
        reply = await self.call(
            self.settings.names.jobs_list,
            {"states": sorted(s.value for s in {*ON_NODE, JobState.QUEUED}), "limit": 1000},
        )
        return msgspec.convert(reply, JobList).jobs

    async def wait_state(
        self, job_id: str, *states: JobState, timeout_s: float = STATE_TIMEOUT_S
    ) -> JobRecord:
        """Poll jobs.get until the job is in one of `states` (a failed request is
        "not yet": services may be restarting)."""
        return await eventually(
            lambda: self.get(job_id),
            f"job {job_id} to reach {[s.value for s in states]}",
            until=lambda job: job.state in states,
            timeout_s=timeout_s,
            retry_on=(Exception,),
        )

    # --- a fake node: a real heartbeat publisher with cards -------------

    async def fake_node(
        self, node: str, cards: list[tuple[int, int]], stop: asyncio.Event, cpu: bool = False
    ) -> None:
        """Heartbeat as node `node` with cards [(total_mib, free_mib)] until `stop`:
        this machine has no GPU, so a node with cards can only be pretended."""

        started = dt.datetime.now(dt.UTC)
        subject = self.settings.names.node_heartbeat(node)
        while not stop.is_set():
            beat = Heartbeat(
                node=node,
                version="fake",
                started_at=started,
                time=dt.datetime.now(dt.UTC),
                cards=[
                    Card(index=i, name="Fake H100", total_mib=t, free_mib=f)
                    for i, (t, f) in enumerate(cards)
                ],
                cpu_training=cpu,
                heartbeat_s=self.settings.heartbeat_s,
                ttl_s=self.settings.node_timeout_s,
            )
            await self.js.publish(subject, bus.encode(beat), msg_ttl=self.settings.node_timeout_s)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.settings.heartbeat_s)


def trainer_pids(agent: ServiceProcess, job_id: str | None = None) -> list[int]:
    """Pids of the stand-in trainers (and their children) an agent started,
    from its log lines (`trainer.started` pid, the stand-in's `pid=... child_pid=...`)."""
    pids: list[int] = []
    for line in agent.lines:
        if job_id is not None and line.get("job_id") not in (None, job_id):
            continue
        if line.get("event") == "trainer.started" and isinstance(line.get("pid"), int):
            pids.append(line["pid"])
        text = str(line.get("message", ""))
        if text.startswith("pid="):
            for part in text.split():
                key, _, value = part.partition("=")
                if key in ("pid", "child_pid") and value.isdigit() and int(value):
                    pids.append(int(value))
    return sorted(set(pids))


def start_requests(agent: ServiceProcess) -> list[str]:
    """Job ids of the start requests an agent accepted (one log line each)."""
    return [str(line.get("job_id")) for line in agent.events("job.accepted")]


@pytest.fixture
def stack_settings() -> dict[str, Any]:
    """Settings the stack runs with; a test module overrides this fixture to change them."""
    return {}


@pytest.fixture
async def stack(
    nats_server: NatsServer, pg_url: str, tmp_path: Path, stack_settings: dict[str, Any]
) -> AsyncIterator[Stack]:
    """Recorder (PostgreSQL), one scheduler and the artifact-store when it exists;
    agents are started by the test (`await stack.agent("node-1")`)."""
    settings = system_settings(nats_server.url, pg_url, tmp_path).with_(**stack_settings)
    async with running_stack(settings, nats_server, tmp_path, "system-test") as s:
        yield s


def system_settings(nats_url: str, database_url: str, tmp_path: Path) -> Settings:
    """The system tests' settings (heartbeat 0.5 s, node timeout 3 s); the
    cluster benches run with them too."""
    return Settings(
        nats_url=nats_url,
        data_dir=str(tmp_path / "data"),
        database_url=database_url,
        heartbeat_s=0.5,
        node_timeout_s=3,
        request_timeout_s=3.0,
    )


@contextlib.asynccontextmanager
async def running_stack(
    settings: Settings, nats_server: NatsServer, tmp_path: Path, client_name: str
) -> AsyncIterator[Stack]:
    """The layout, the recorder, the artifact-store (when it exists) and one
    scheduler on `settings`; on the way out agents stop first, so their jobs
    end while the others still answer."""
    nc = await bus.connect(settings, client_name)
    js = nc.jetstream()
    await runtime.ensure_layout_retrying(js, settings)
    recorder = ServiceProcess("lorafleet_services.recorder", settings)
    s = Stack(settings, nats_server, nc, js, tmp_path, recorder, procs=[recorder])
    try:
        await recorder.start()
        if has_artifact_store():
            s.artifact_store = ServiceProcess("lorafleet_services.artifact_store", settings)
            s.procs.append(s.artifact_store)
            await s.artifact_store.start()
        await s.scheduler()
        yield s
    finally:
        for proc in [*s.agents.values(), *s.procs]:
            with contextlib.suppress(Exception):
                await proc.stop(timeout_s=5)
        await bus.drain_quietly(nc)


def kill_pid(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def kill_agent(agent: ServiceProcess, job_id: str | None = None) -> None:
    """SIGKILL an agent and the trainers it started (of `job_id`, if given):
    the machine went away."""
    pids = trainer_pids(agent, job_id)
    agent.kill()
    for pid in pids:
        kill_pid(pid)
