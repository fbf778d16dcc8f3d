"""The agent's own subjects (`node.<node>.start`, `.cancel`, `.checkpoint`,
`.serve`, `.unserve`) fuzzed against a real agent, from the request Structs' JSON
Schemas, with tests/fuzz/test_endpoints.py's strategies.

One nats-server and one real agent (the stand-in trainer) for the module;
nothing else: no scheduler dispatches or cancels behind the requests' backs.
What must hold, for every request:

- the reply comes within the request timeout (no hang) and is a reply of
  the subject's Struct or a typed error (`ErrorReply`), never `internal`;
- a request wrong in one field is refused as `bad_request` naming it;
- an error reply changes nothing the agent keeps: no job started (its
  heartbeat names none), nothing on the status or artifacts streams, nothing
  new in its work directory (job directories, the served set);
- the agent is still up and answering at the end.

A valid start may be accepted: the agent then runs it (its dataset is not
in the bucket, so it fails at once) and the next state is taken once it
has ended.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
import pytest_asyncio
from hypothesis import given
from hypothesis import strategies as st
from nats.aio.client import Client
from nats.js import JetStreamContext

from lorafleet.names import Names, kv_stream
from lorafleet.nats import _bus as bus
from lorafleet.nats.server import NatsServer
from lorafleet_schemas.messages import (
    ErrorCode,
    Heartbeat,
    NodeCancelReply,
    NodeCancelRequest,
    NodeCheckpointReply,
    NodeCheckpointRequest,
    NodeServeReply,
    NodeServeRequest,
    NodeUnserveRequest,
    StartReply,
    StartRequest,
)
from tests.eventually import eventually
from tests.fuzz.schemas import Hints, Invalid, Only, invalid, request_schema, valid
from tests.fuzz.test_endpoints import REPLY_TIMEOUT_S, error_of
from tests.procs import ServiceProcess, agent_process
from tests.system.conftest import system_settings

#: The stack lives on the module's event loop; so do the tests that use it.
ON_MODULE_LOOP = pytest.mark.asyncio(loop_scope="module")

N = Names()
NODE = "node-1"
#: Seconds the agent's state must stay the same to count as settled.
SETTLED_S = 0.3

#: Every subject the agent answers: its request and reply Structs.
ENDPOINTS: dict[str, tuple[type, type]] = {
    N.node_start(NODE): (StartRequest, StartReply),
    N.node_cancel(NODE): (NodeCancelRequest, NodeCancelReply),
    N.node_checkpoint(NODE): (NodeCheckpointRequest, NodeCheckpointReply),
    N.node_serve(NODE): (NodeServeRequest, NodeServeReply),
    N.node_unserve(NODE): (NodeUnserveRequest, NodeServeReply),
}


@dataclass
class NodeStack:
    nc: Client
    js: JetStreamContext
    agent: ServiceProcess
    work_dir: Path

    def __repr__(self) -> str:  # hypothesis prints it with every failing example
        return f"NodeStack({NODE})"

    async def snapshot(self) -> dict[str, Any]:
        """What the agent keeps: the job its heartbeat names, the streams'
        last sequences, and every path under its work directory."""
        entry = await self.js.get_msg(kv_stream(N.nodes_bucket), subject=N.node_heartbeat(NODE))
        beat = msgspec.json.decode(entry.data or b"", type=Heartbeat)
        out: dict[str, Any] = {"job": beat.job}
        for stream in (N.status_stream, N.artifacts_stream):
            out[stream] = (await self.js.stream_info(stream)).state.last_seq
        out["files"] = sorted(str(p.relative_to(self.work_dir)) for p in self.work_dir.rglob("*"))
        return out

    async def settled(self) -> dict[str, Any]:
        """The snapshot once the agent runs no job and nothing moves."""

        async def same_twice() -> dict[str, Any] | None:
            first = await self.snapshot()
            await asyncio.sleep(SETTLED_S)
            second = await self.snapshot()
            return second if first == second and second["job"] is None else None

        return await eventually(same_twice, "the agent idle and its state still")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def node_stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[NodeStack]:
    tmp = tmp_path_factory.mktemp("fuzz-node")
    async with NatsServer(tmp / "nats") as server:
        settings = system_settings(server.url, f"sqlite:///{tmp / 'unused.db'}", tmp)
        nc = await bus.connect(settings, "fuzz-node")
        js = nc.jetstream()
        await bus.ensure_layout(js, bus.layout_for(settings))
        agent = agent_process(settings, tmp, NODE)
        try:
            await agent.start()
            await eventually(
                lambda: js.get_msg(kv_stream(N.nodes_bucket), subject=N.node_heartbeat(NODE)),
                "the agent's first beat",
                retry_on=(Exception,),
            )
            yield NodeStack(nc, js, agent, tmp / f"agent-{NODE}")
        finally:
            await agent.stop()
            await bus.drain_quietly(nc)


def hints() -> Hints:
    """Job ids the agent takes as names (past "not a valid job id"), and
    times: msgspec's schema of a datetime says only "string"."""
    return {
        "job_id": st.from_regex(r"\Afuzz-[a-z0-9]{1,12}\Z"),
        "created_at": Only(st.datetimes(timezones=st.just(dt.UTC)).map(dt.datetime.isoformat)),
    }


async def send(stack: NodeStack, subject: str, body: dict[str, Any]) -> bytes:
    msg = await stack.nc.request(subject, json.dumps(body).encode(), timeout=REPLY_TIMEOUT_S)
    return msg.data


def test_every_subject_of_the_agent_is_fuzzed() -> None:
    requests = {
        getattr(N, name)(NODE)
        for name in dir(Names)
        if name.startswith("node_") and callable(getattr(Names, name))
    }
    answered = {s for s in requests if s.startswith(f"{N.prefix}.node.{NODE}.")}
    assert answered == set(ENDPOINTS)


@ON_MODULE_LOOP
@pytest.mark.parametrize("subject", sorted(ENDPOINTS))
@given(data=st.data())
async def test_valid_requests_get_a_reply_or_a_typed_error(
    node_stack: NodeStack, subject: str, data: st.DataObject
) -> None:
    request_type, reply_type = ENDPOINTS[subject]
    schema, defs = request_schema(request_type)
    body = data.draw(valid(schema, defs, hints()), label="request")
    before = await node_stack.settled()
    raw = await send(node_stack, subject, body)
    error = error_of(raw)
    if error is None:
        msgspec.json.decode(raw, type=reply_type)
        return
    assert error.error.code is not ErrorCode.INTERNAL, error
    assert error.error.field, f"{subject} {body}: an error naming no field: {error}"
    assert await node_stack.snapshot() == before, f"{subject} {body} changed state: {error}"


@ON_MODULE_LOOP
@pytest.mark.parametrize("subject", sorted(ENDPOINTS))
@given(data=st.data())
async def test_a_request_wrong_in_one_field_is_refused_naming_it(
    node_stack: NodeStack, subject: str, data: st.DataObject
) -> None:
    request_type, _ = ENDPOINTS[subject]
    schema, defs = request_schema(request_type)
    wrong: Invalid = data.draw(invalid(schema, defs, hints()), label="request")
    before = await node_stack.settled()
    raw = await send(node_stack, subject, wrong.body)
    error = error_of(raw)
    assert error is not None, f"{subject} took {wrong.body} ({wrong.field} {wrong.how})"
    assert error.error.code is ErrorCode.BAD_REQUEST, error
    assert error.error.field == wrong.field, (wrong, error)
    await asyncio.sleep(SETTLED_S)  # anything it started would show by now
    assert await node_stack.snapshot() == before, f"{subject} {wrong} changed state"


@ON_MODULE_LOOP
async def test_the_agent_is_still_up(node_stack: NodeStack) -> None:
    assert node_stack.agent.running, f"the agent exited: {node_stack.agent.tail()}"
    raw = await send(node_stack, N.node_cancel(NODE), {"job_id": "fuzz-none"})
    assert msgspec.json.decode(raw, type=NodeCancelReply) == NodeCancelReply(stopped=False)
