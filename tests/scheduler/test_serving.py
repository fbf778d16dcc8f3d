"""`api.adapters.serve` / `unserve` on a real nats-server with a real recorder
(PostgreSQL) and scheduler in-process; the agent's side is a real NATS
subscriber on `node.<n>.serve` answering NodeServeReply (the agent's
interface). Each refusal is checked by its message; the checks themselves
are plain functions, tested first without a bus."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from lorafleet._tasks import stop_tasks
from lorafleet.client import Client as Lorafleet
from lorafleet.errors import ConflictError, NotFoundError
from lorafleet.names import Names
from lorafleet.nats import _bus as bus
from lorafleet.settings import Settings
from lorafleet_schemas.messages import (
    AdapterServeRequest,
    AdapterUnserveRequest,
    ArtifactKind,
    CheckpointRef,
    Engine,
    EngineRef,
    Heartbeat,
    JobState,
    ModelRecord,
    NodeServeReply,
    NodeServeRequest,
    NodeUnserveRequest,
    ServingRecord,
    ServingState,
)
from lorafleet_services.recorder import db
from lorafleet_services.recorder.service import Recorder
from lorafleet_services.scheduler.dispatch import start_request
from lorafleet_services.scheduler.node_table import Node
from lorafleet_services.scheduler.service import Scheduler
from lorafleet_services.scheduler.serving import (
    engine_refusal,
    job_refusal,
    node_refusal,
    serve_node,
    unserve_targets,
)
from tests.eventually import eventually
from tests.recorder.test_service import QA, add_model, raw
from tests.recorder.test_servings import report
from tests.records import job_record

N = Names()
ENGINE = "http://127.0.0.1:8000"
NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def beat(node: str, engines: tuple[str, ...] = ()) -> Heartbeat:
    t = dt.datetime.now(dt.UTC)
    return Heartbeat(
        node=node, version="t", started_at=t, time=t,
        serving=[EngineRef(kind=Engine.VLLM, url=u, model="tiny") for u in engines],
    )  # fmt: skip


# --- the checks, without a bus ---------------------------------------------------


def test_a_job_is_served_only_done_with_its_adapter() -> None:
    adapter = CheckpointRef(
        job_id="job1", kind=ArtifactKind.PEFT, object="job1/peft", size=1, sha256="a" * 64
    )
    assert job_refusal("job1", job_record(state=JobState.DONE, adapter=adapter)) is None
    for job, kind, words in [
        (None, NotFoundError, "no job job1: list jobs"),
        (job_record(state=JobState.RUNNING), ConflictError, "is running: an adapter is served "
         "once its job is done; wait for it (`lorafleet follow job1`)"),
        (job_record(state=JobState.FAILED), ConflictError, "ended failed, so it has no "
         "finished adapter"),
        (job_record(state=JobState.DONE), ConflictError, "holds no stored PEFT adapter"),
    ]:  # fmt: skip
        refusal = job_refusal("job1", job)
        assert isinstance(refusal, kind) and words in refusal.message, (job, refusal)
        assert refusal.field == "$.job_id"


def test_a_node_is_asked_only_alive_and_an_engine_only_if_it_runs() -> None:
    hb = beat("n1", (ENGINE,))
    assert node_refusal("n1", Node(heartbeat=hb, last_seen=0.0)) is None
    never = node_refusal("n9", None)
    assert never is not None and "node n9 has sent no heartbeat" in never.message
    lost = node_refusal("n1", Node(heartbeat=hb, last_seen=0.0, alive=False))
    assert lost is not None and "node n1 is not alive (last heartbeat" in lost.message
    node = Node(heartbeat=hb, last_seen=0.0)
    assert engine_refusal(node, None) is None and engine_refusal(node, ENGINE) is None
    other = engine_refusal(node, "http://elsewhere:1")
    assert other is not None and f"the engines it runs: {ENGINE}" in other.message


def test_where_serve_and_unserve_go() -> None:
    job = job_record(node="n1")
    assert serve_node(job, AdapterServeRequest(job_id="job1")) == "n1"
    assert serve_node(job, AdapterServeRequest(job_id="job1", node="n2")) == "n2"
    with pytest.raises(Exception, match="ran on no node: name one with --node"):
        serve_node(job_record(), AdapterServeRequest(job_id="job1"))
    records = [
        msgspec.convert(
            {**msgspec.to_builtins(report("job1", 1, state, node=n, engine=e)),
             "created_at": NOW, "updated_at": NOW},
            type=ServingRecord,
        )
        for n, e, state in [("n1", ENGINE, ServingState.SERVED), ("n2", ENGINE,
                            ServingState.UNLOADED), ("n3", "http://b:1", ServingState.REFUSED)]
    ]  # fmt: skip
    assert unserve_targets(records, AdapterUnserveRequest(job_id="job1")) == ["n1", "n3"]
    assert unserve_targets(records, AdapterUnserveRequest(job_id="job1", engine=ENGINE)) == ["n1"]
    assert unserve_targets([], AdapterUnserveRequest(job_id="job1", node="n7")) == ["n7"]


# --- over NATS -------------------------------------------------------------------


@dataclass
class Fleet:
    settings: Settings
    nc: Client  # a plain client
    scheduler: Scheduler
    asked: list[tuple[str, Any]] = field(default_factory=list)


@pytest.fixture
async def fleet(settings: Settings, pg_url: str) -> AsyncIterator[Fleet]:
    s = settings.with_(database_url=pg_url, node_timeout_s=1, heartbeat_s=0.25,
                       request_timeout_s=1.0)  # fmt: skip
    rnc = await bus.connect(s, "recorder-under-test")
    await bus.ensure_layout(rnc.jetstream(), bus.layout_for(s))
    recorder = Recorder(s, rnc, db.create_engine(pg_url))
    await recorder.start()
    snc = await bus.connect(s, "scheduler-under-test")
    scheduler = Scheduler(snc, s, instance="s1")
    await scheduler.start()
    nc = await bus.connect(s, "test")
    fleet = Fleet(s, nc, scheduler)
    beating = asyncio.create_task(_beat(nc, s, ["n1", "n3"]))
    try:
        yield fleet
    finally:
        # Cancelled again until it ends: its publishes await through
        # wait_for, which on 3.11 can lose one cancel (lorafleet._tasks); a
        # CI run's teardown hung here for its 180 s.
        await stop_tasks(beating)
        await scheduler.stop()
        await recorder.stop()
        for c in (nc, snc, rnc):
            await bus.drain_quietly(c)


async def _beat(nc: Client, s: Settings, nodes: list[str]) -> None:
    js = nc.jetstream()
    while True:
        for node in nodes:
            hb = bus.encode(beat(node, (ENGINE,)))
            await js.publish(N.node_heartbeat(node), hb, msg_ttl=s.node_timeout_s)
        await asyncio.sleep(s.heartbeat_s)


async def agent_side(fleet: Fleet, node: str, engines: list[str], reason: str = "") -> None:
    """The agent's interface: answer node.<node>.serve/unserve, keep what was asked."""

    async def answer(msg: Msg) -> None:
        kind = NodeServeRequest if msg.subject.endswith(".serve") else NodeUnserveRequest
        fleet.asked.append((msg.subject, msgspec.json.decode(msg.data, type=kind)))
        await msg.respond(bus.encode(NodeServeReply(engines=engines, reason=reason)))

    await fleet.nc.subscribe(N.node_serve(node), cb=answer)
    await fleet.nc.subscribe(N.node_unserve(node), cb=answer)
    await fleet.nc.flush()


async def done_job(nc: Client) -> dict[str, Any]:
    """A job of model tiny (in the catalog) trained on n1 and done, its PEFT adapter stored."""
    job, _ = await raw(nc, N.jobs_submit, {"model": "tiny", "gpu_memory_mib": 100, "data": QA})
    move = {"id": job["id"], "from_state": "queued", "to_state": "starting", "node": "n1"}
    await raw(nc, N.store_transition, move)
    await raw(nc, N.store_transition, {**move, "from_state": "starting", "to_state": "uploading"})
    done, _ = await raw(
        nc, N.store_artifact,
        {"id": job["id"], "kind": "peft", "size": 9, "sha256": "b" * 64,
         "object": f"{job['id']}/peft"},
    )  # fmt: skip
    assert done["state"] == "done" and done["adapter"]["sha256"] == "b" * 64, done
    return dict(done)


async def alive(fleet: Fleet, *nodes: str) -> None:
    table = fleet.scheduler.nodes.table.nodes
    await eventually(
        lambda: all(n in table and table[n].alive for n in nodes), f"{nodes} alive in the table"
    )


async def test_serve_is_sent_to_the_node_and_its_answer_is_the_reply(fleet: Fleet) -> None:
    nc = fleet.nc
    await add_model(nc, "tiny")
    job = await done_job(nc)
    await agent_side(fleet, "n1", [ENGINE])
    await alive(fleet, "n1")
    reply, _ = await raw(nc, N.adapters_serve, {"job_id": job["id"]})
    assert reply == {"engines": [ENGINE], "reason": "", "node": "n1"}, reply
    [(subject, asked)] = fleet.asked
    assert subject == N.node_serve("n1") and asked.job_id == job["id"]
    assert (asked.object, asked.sha256) == (f"{job['id']}/peft", "b" * 64)
    assert asked.model.name == "tiny" and asked.engine is None
    reply, _ = await raw(nc, N.adapters_serve, {"job_id": job["id"], "engine": "http://x:1"})
    assert (
        reply["error"]["code"] == "bad_request" and "runs no engine at" in reply["error"]["message"]
    ), reply

    # Unserve goes where a record is not unloaded: none yet.
    reply, _ = await raw(nc, N.adapters_unserve, {"job_id": job["id"]})
    assert (
        reply["error"]["code"] == "not_found" and "is served nowhere" in reply["error"]["message"]
    ), reply
    js = nc.jetstream()
    served = report(job["id"], 1, ServingState.SERVED, node="n1", model="tiny")
    await js.publish(N.serving_report("n1", job["id"]), bus.encode(served))
    await eventually(
        lambda: raw(nc, N.adapters_list, {"job_id": job["id"]}), "the record",
        until=lambda r: len(r[0]["adapters"]) == 1,
    )  # fmt: skip
    reply, _ = await raw(nc, N.adapters_unserve, {"job_id": job["id"]})
    assert reply == {"replies": [{"engines": [ENGINE], "reason": "", "node": "n1"}]}, reply
    assert fleet.asked[-1] == (N.node_unserve("n1"), NodeUnserveRequest(job_id=job["id"]))


async def test_serve_refuses_clearly_and_sends_nothing(fleet: Fleet) -> None:
    nc = fleet.nc
    await add_model(nc, "tiny")
    queued, _ = await raw(nc, N.jobs_submit, {"model": "tiny", "gpu_memory_mib": 100, "data": QA})
    job = await done_job(nc)
    await agent_side(fleet, "n9", [ENGINE])
    await alive(fleet, "n1")
    # (A node lost after beating is refused the same way: the plain test above.)
    cases = [
        ({"job_id": "nope"}, "not_found", "no job nope"),
        ({"job_id": queued["id"]}, "conflict", "is queued: an adapter is served once its job"),
        ({"job_id": job["id"], "node": "n9"}, "unavailable", "node n9 has sent no heartbeat"),
        ({"job_id": job["id"], "colour": "red"}, "bad_request", "colour"),
    ]
    for body, code, words in cases:
        reply, _ = await raw(nc, N.adapters_serve, body)
        assert reply["error"]["code"] == code and words in reply["error"]["message"], reply
    assert fleet.asked == []


async def test_an_agent_that_does_not_answer_is_a_clear_error(fleet: Fleet) -> None:
    nc = fleet.nc
    await add_model(nc, "tiny")
    job = await done_job(nc)
    await alive(fleet, "n1", "n3")
    # n3 beats, but nothing takes its serve requests.
    reply, _ = await raw(nc, N.adapters_serve, {"job_id": job["id"], "node": "n3"})
    assert reply["error"]["code"] == "unavailable", reply
    assert "the agent on node n3 does not take serve requests" in reply["error"]["message"]

    async def silent(msg: Msg) -> None:
        del msg  # takes it, never answers

    await nc.subscribe(N.node_serve("n1"), cb=silent)
    await nc.flush()
    reply, _ = await raw(nc, N.adapters_serve, {"job_id": job["id"]})
    assert reply["error"]["code"] == "unavailable", reply
    assert "the agent on node n1 did not answer in time" in reply["error"]["message"], reply
    assert json.loads(json.dumps(reply))["error"]["field"] == "$.node"


async def cli(fleet: Fleet, *args: str) -> tuple[int, str, str]:
    """`lorafleet ARGS` as a person runs it, against this fleet."""
    env = {**os.environ, **fleet.settings.to_env(), "COLUMNS": "200"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "lorafleet_services.cli", *args, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_a_job_keeps_its_serve_wish_from_the_cli_to_the_start_request(
    fleet: Fleet, tmp_path: Path
) -> None:
    await add_model(fleet.nc, "tiny")
    data = tmp_path / "pairs.jsonl"
    data.write_text(QA)
    wishes = {}
    for flag in ("--serve", "--no-serve", None):
        argv = [
            "submit",
            "--model",
            "tiny",
            "--gpu-memory-mib",
            "100",
            "--data",
            str(data),
            "--json",
        ]
        code, out, err = await cli(fleet, *argv, *([flag] if flag else []))
        assert code == 0, err
        wishes[flag] = json.loads(out)
    assert [w["serve"] for w in wishes.values()] == [True, False, None]
    model = msgspec.convert(await add_model(fleet.nc, "tiny-2"), type=ModelRecord)
    for wish in (True, False, None):
        assert start_request(job_record(serve=wish), model).serve is wish


async def test_the_client_and_the_cli_serve_list_and_refuse(fleet: Fleet) -> None:
    nc = fleet.nc
    await add_model(nc, "tiny")
    job = await done_job(nc)
    await agent_side(fleet, "n1", [ENGINE])
    await alive(fleet, "n1")
    async with await Lorafleet.connect(fleet.settings) as lf:
        reply = await lf.serve(job["id"])
        assert (reply.node, reply.engines) == ("n1", [ENGINE])
        assert await lf.adapters([job["id"]]) == []
        with pytest.raises(NotFoundError, match="is served nowhere"):
            await lf.unserve(job["id"])
    code, out, _ = await cli(fleet, "serve", job["id"])
    assert code == 0 and out.strip() == f"{job['id']}: node n1 loads into {ENGINE}", out
    refused = report(job["id"], 1, ServingState.REFUSED, node="n1", model="tiny",
                     reason="rank 32 is over 16", lift="--max-lora-rank 32")  # fmt: skip
    await nc.jetstream().publish(N.serving_report("n1", job["id"]), bus.encode(refused))
    async with await Lorafleet.connect(fleet.settings) as lf:
        await eventually(lambda: lf.adapters([job["id"]]), "the record", until=bool)
    code, out, _ = await cli(fleet, "adapters", "--job", job["id"])
    assert code == 0 and "adapters (1)" in out, out
    assert "refused" in out and "rank 32 is over 16" in out and "--max-lora-rank 32" in out, out
    code, out, _ = await cli(fleet, "adapters", "--node", "n2")
    assert code == 0 and "adapters (0)" in out, out
    code, _, err = await cli(fleet, "serve", job["id"], "--node", "n9")
    assert code == 1 and "node n9 has sent no heartbeat" in err and len(err.splitlines()) == 1
