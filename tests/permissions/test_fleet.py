"""The whole system on a server with lorafleet's users: the services log in as
the service user, the agent as node-1 (its own subjects only), and a job runs
to `done` with the stand-in trainer. Nothing is refused on the way."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import nats.js.errors
import pytest

from lorafleet import bus
from lorafleet.log import Event
from lorafleet_services.agent.config import AgentConfig
from tests.permissions.conftest import Fleet
from tests.procs import ServiceProcess

DATA = "".join(json.dumps({"q": f"what is {i}+{i}?", "a": str(2 * i)}) + "\n" for i in range(20))


async def test_a_job_ends_done_with_the_agent_on_node_1_credentials(
    fleet: Fleet, sqlite_url: str, tmp_path: Any
) -> None:
    svc = fleet.service_settings().with_(database_url=sqlite_url)
    names = svc.names
    nc = await bus.connect(svc, "test-client")
    procs: list[ServiceProcess] = []
    try:
        for module in ("recorder", "artifact_store", "scheduler"):
            proc = ServiceProcess(f"lorafleet_services.{module}", svc)
            procs.append(proc)
            await proc.start()
        cfg = AgentConfig(
            node="node-1",
            work_dir=tmp_path / "agent-node-1",
            engines_dir=tmp_path / "engines",
            trainer="standin",
            allow_cpu=True,
            cancel_grace_s=1.0,
        )
        agent = ServiceProcess(
            "lorafleet_services.agent", fleet.node_settings("node-1"), env=cfg.to_env()
        )
        procs.append(agent)
        await agent.start()

        async def call(subject: str, body: dict[str, Any]) -> Any:
            msg = await nc.request(subject, json.dumps(body).encode(), timeout=10)
            bus.raise_for_error(msg.data, msg.headers)
            return json.loads(msg.data)

        base = tmp_path / "models" / "tiny"
        base.mkdir(parents=True)
        await call(names.models_add, {"name": "tiny", "engine": "vllm", "local_dir": str(base)})
        job = await call(
            names.jobs_submit,
            {"model": "tiny", "gpu_memory_mib": 1000, "data": DATA, "node": "node-1"},
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        state = job["state"]
        while state not in ("done", "failed", "cancelled") and loop.time() < deadline:
            await asyncio.sleep(0.1)
            job = await call(names.jobs_get, {"id": job["id"]})
            state = job["state"]
        assert state == "done", job
        listed = await call(names.artifacts_list, {"job_id": job["id"]})
        assert {a["kind"] for a in listed["artifacts"]} >= {"peft"}

        # The agent could not create the layout (the services did) and said so
        # at once; nothing else any process did was refused.
        said = agent.events(Event.NATS_REFUSED)
        assert [ln["level"] for ln in said] == ["warning", "info"], said
        assert "$js.api.stream.create" in said[0]["message"]
        for proc in procs[:-1]:
            assert proc.events(Event.NATS_REFUSED) == [], proc.module

        # A clean stop deletes node-1's heartbeat (a plain publish of the KV delete).
        await agent.stop()
        kv = await nc.jetstream().key_value(names.nodes_bucket)
        with pytest.raises((nats.js.errors.KeyDeletedError, nats.js.errors.KeyNotFoundError)):
            await kv.get("node-1")
        assert agent.events(Event.NATS_REFUSED) == said
    finally:
        for proc in reversed(procs):
            with contextlib.suppress(Exception):
                await proc.stop(timeout_s=5)
        await bus.drain_quietly(nc)
