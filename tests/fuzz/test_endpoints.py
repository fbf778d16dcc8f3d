"""Every API endpoint fuzzed against a real stack, from the request Structs' JSON Schemas.

One stack for the module: a nats-server, PostgreSQL, the recorder, the
artifact-store and a scheduler (a follower: this module holds the leader
key, so nothing dispatches or rewrites a job behind the requests' backs).
For every endpoint the names module lists (`api.*`, `store.*`), hypothesis
sends requests valid at their bounds and requests wrong in one field.

What must hold, for every request:

- the reply comes within the request timeout (no hang) and is either a
  reply of the endpoint's Struct or a typed error (`ErrorReply`), never
  `internal`;
- an error names the field at fault: for a request wrong in one field,
  that field, as `bad_request`;
- an error reply changes nothing: the database (every table's rows) and
  the JetStream streams are the same before and after it;
- the services are still up at the end.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import psycopg
import pytest
import pytest_asyncio
from hypothesis import given
from hypothesis import strategies as st
from nats.aio.client import Client
from sqlalchemy.engine import make_url

from lorafleet import log
from lorafleet.names import Names, kv_stream
from lorafleet.nats import _bus as bus
from lorafleet.nats.server import NatsServer
from lorafleet_schemas.messages import (
    AdapterList,
    AdapterListRequest,
    AdapterServeRequest,
    AdapterUnserveReply,
    AdapterUnserveRequest,
    ArtifactGetRequest,
    ArtifactList,
    ArtifactListRequest,
    ArtifactRecord,
    ArtifactStoredRequest,
    ErrorCode,
    ErrorReply,
    GcReport,
    GcRequest,
    JobCancelRequest,
    JobCurve,
    JobCurveRequest,
    JobDeleteRequest,
    JobEstimate,
    JobEstimateRequest,
    JobGetRequest,
    JobList,
    JobListRequest,
    JobRecord,
    JobResumeRequest,
    JobSpec,
    ModelList,
    ModelListRequest,
    ModelRecord,
    ModelSpec,
    NodeInfo,
    NodeList,
    NodeListRequest,
    NodeScheduleRequest,
    NodeServeReply,
    TransitionReply,
    TransitionRequest,
)
from lorafleet_services.scheduler.leadership import Leadership
from tests.eventually import eventually
from tests.fuzz.schemas import Invalid, invalid, request_schema, valid
from tests.pg import throwaway_database
from tests.system.conftest import DATA, Stack, running_stack, system_settings

#: The stack lives on the module's event loop; so do the tests that use it.
ON_MODULE_LOOP = pytest.mark.asyncio(loop_scope="module")

N = Names()
#: Seconds a reply may take: more is a hang.
REPLY_TIMEOUT_S = 5.0

#: Every endpoint: its request and reply Structs.
ENDPOINTS: dict[str, tuple[type, type]] = {
    N.models_add: (ModelSpec, ModelRecord),
    N.models_list: (ModelListRequest, ModelList),
    N.jobs_submit: (JobSpec, JobRecord),
    N.jobs_get: (JobGetRequest, JobRecord),
    N.jobs_list: (JobListRequest, JobList),
    N.jobs_curve: (JobCurveRequest, JobCurve),
    N.jobs_estimate: (JobEstimateRequest, JobEstimate),
    N.jobs_resume: (JobResumeRequest, JobRecord),
    N.jobs_delete: (JobDeleteRequest, JobRecord),
    N.jobs_cancel: (JobCancelRequest, JobRecord),
    N.store_transition: (TransitionRequest, TransitionReply),
    N.store_artifact: (ArtifactStoredRequest, JobRecord),
    N.nodes_list: (NodeListRequest, NodeList),
    N.nodes_schedule: (NodeScheduleRequest, NodeInfo),
    N.artifacts_list: (ArtifactListRequest, ArtifactList),
    N.artifacts_get: (ArtifactGetRequest, ArtifactRecord),
    N.adapters_serve: (AdapterServeRequest, NodeServeReply),
    N.adapters_unserve: (AdapterUnserveRequest, AdapterUnserveReply),
    N.adapters_list: (AdapterListRequest, AdapterList),
    N.artifacts_gc: (GcRequest, GcReport),
    N.datasets_gc: (GcRequest, GcReport),
}


@dataclass
class FuzzStack:
    stack: Stack
    database_url: str
    job_ids: list[str]

    def __repr__(self) -> str:  # hypothesis prints it with every failing example
        return f"FuzzStack(jobs={self.job_ids})"

    @property
    def nc(self) -> Client:
        return self.stack.nc

    async def snapshot(self) -> dict[str, Any]:
        """Every table's rows (as one digest each) and every stream's last
        sequence, but the leader key's (this module renews it every second)."""
        u = make_url(self.database_url)
        conninfo = f"host={u.host} port={u.port} user={u.username} dbname={u.database}"
        out: dict[str, Any] = {}
        async with await psycopg.AsyncConnection.connect(conninfo, autocommit=True) as conn:
            tables = await conn.execute(
                "SELECT table_name FROM information_schema.tables WHERE table_schema = 'public'"
            )
            for (table,) in await tables.fetchall():
                rows = await conn.execute(
                    f"SELECT md5(coalesce(string_agg(t::text, '|' ORDER BY t::text), '')) "
                    f'FROM "{table}" t'
                )
                out[table] = (await rows.fetchone() or ("",))[0]
        for info in await self.stack.js.streams_info():
            if info.config.name != kv_stream(N.leader_bucket):
                out[f"stream {info.config.name}"] = info.state.last_seq
        return out


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fuzz_stack(
    tmp_path_factory: pytest.TempPathFactory, pg_template: str
) -> AsyncIterator[FuzzStack]:
    tmp = tmp_path_factory.mktemp("fuzz")
    async with NatsServer(tmp / "nats") as server:
        with throwaway_database(template=pg_template) as url:
            settings = system_settings(server.url, url, tmp)
            nc = await bus.connect(settings, "fuzz-leader")
            await bus.ensure_layout(nc.jetstream(), bus.layout_for(settings))
            lead = Leadership(nc.jetstream(), N, "fuzz-holds-the-lead", log.get())
            lead.start()
            try:
                await eventually(lead.is_leader, "this module to hold the leader key")
                async with running_stack(settings, server, tmp, "fuzz") as stack:
                    yield FuzzStack(stack, url, await seed(stack))
            finally:
                await lead.stop()
                await bus.drain_quietly(nc)


async def seed(stack: Stack) -> list[str]:
    """A model and two jobs, one queued and one cancelled, for requests to name."""
    await stack.add_model("tiny")
    queued = await stack.submit("node-1")
    cancelled = await stack.submit("node-1")
    await stack.call(
        N.store_transition,
        {"id": cancelled.id, "from_state": "queued", "to_state": "cancelled"},
    )
    return [queued.id, cancelled.id]


def hints(fuzz: FuzzStack) -> dict[str, st.SearchStrategy[Any]]:
    """Names the stack knows, mixed into the schemas' values: past "not found"."""
    ids = st.sampled_from(fuzz.job_ids)
    return {
        "id": ids,
        "job_id": ids,
        "model": st.just("tiny"),
        "data": st.just(DATA),
        "local_dir": st.just(str(Path("/models/tiny"))),
    }


async def send(fuzz: FuzzStack, subject: str, body: dict[str, Any]) -> tuple[bytes, Any]:
    msg = await fuzz.nc.request(subject, json.dumps(body).encode(), timeout=REPLY_TIMEOUT_S)
    return msg.data, json.loads(msg.data)


def error_of(data: bytes) -> ErrorReply | None:
    """The error reply in `data`, or None for a reply that is not one."""
    if b'"error"' not in data:
        return None
    try:
        return msgspec.json.decode(data, type=ErrorReply)
    except msgspec.ValidationError:
        return None


def test_every_endpoint_the_names_list_is_fuzzed() -> None:
    subjects = {
        getattr(N, name)
        for name in dir(Names)
        if isinstance(getattr(Names, name), property)
        and any(f"{N.prefix}.{part}." in getattr(N, name) for part in ("api", "store"))
    }
    assert subjects == set(ENDPOINTS)


@ON_MODULE_LOOP
@pytest.mark.parametrize("subject", sorted(ENDPOINTS))
@given(data=st.data())
async def test_valid_requests_get_a_reply_or_a_typed_error(
    fuzz_stack: FuzzStack, subject: str, data: st.DataObject
) -> None:
    request_type, reply_type = ENDPOINTS[subject]
    schema, defs = request_schema(request_type)
    body = data.draw(valid(schema, defs, hints(fuzz_stack)), label="request")
    before = await fuzz_stack.snapshot()
    raw, _ = await send(fuzz_stack, subject, body)
    error = error_of(raw)
    if error is None:
        msgspec.json.decode(raw, type=reply_type)
        return
    assert error.error.code is not ErrorCode.INTERNAL, error
    assert error.error.field, f"{subject} {body}: an error naming no field: {error}"
    assert await fuzz_stack.snapshot() == before, f"{subject} {body} changed state: {error}"


@ON_MODULE_LOOP
@pytest.mark.parametrize("subject", sorted(ENDPOINTS))
@given(data=st.data())
async def test_a_request_wrong_in_one_field_is_refused_naming_it(
    fuzz_stack: FuzzStack, subject: str, data: st.DataObject
) -> None:
    request_type, _ = ENDPOINTS[subject]
    schema, defs = request_schema(request_type)
    wrong: Invalid = data.draw(invalid(schema, defs, hints(fuzz_stack)), label="request")
    before = await fuzz_stack.snapshot()
    raw, _ = await send(fuzz_stack, subject, wrong.body)
    error = error_of(raw)
    assert error is not None, f"{subject} took {wrong.body} ({wrong.field} {wrong.how})"
    assert error.error.code is ErrorCode.BAD_REQUEST, error
    assert error.error.field == wrong.field, (wrong, error)
    assert await fuzz_stack.snapshot() == before, f"{subject} {wrong} changed state"


@ON_MODULE_LOOP
async def test_the_services_are_still_up(fuzz_stack: FuzzStack) -> None:
    for proc in fuzz_stack.stack.procs:
        assert proc.running, f"{proc.module} exited: {proc.tail()}"
    raw, reply = await send(fuzz_stack, N.jobs_list, {})
    assert error_of(raw) is None and isinstance(reply["jobs"], list), raw
    for job_id in fuzz_stack.job_ids:
        raw, _ = await send(fuzz_stack, N.jobs_get, {"id": job_id})
        error = error_of(raw)
        # A well-formed api.jobs.delete the fuzzer sent may have deleted an
        # ended job (the queued one cancelled first): gone is fine, broken is not.
        assert error is None or error.error.code is ErrorCode.NOT_FOUND, error


#: What the fuzzing found, each kept as the request that showed it.
FOUND = [
    # PostgreSQL refuses a NUL in text: it was an internal error (and on
    # the status stream, a batch redelivered forever).
    pytest.param(N.jobs_get, {"id": "j\x00"}, "$.id", id="nul-in-a-text"),
    pytest.param(
        N.models_add,
        {"name": "m", "engine": "vllm", "hf_repo": "o/\x00"},
        "$.hf_repo",
        id="nul-in-an-optional-text",
    ),
    # gpu_memory_mib has no upper bound on the wire; its column is 32-bit.
    pytest.param(
        N.jobs_submit,
        {"model": "tiny", "data": DATA, "gpu_memory_mib": 2**63 - 1},
        "$.gpu_memory_mib",
        id="mib-beyond-32-bits",
    ),
]


@ON_MODULE_LOOP
@pytest.mark.parametrize(("subject", "body", "field"), FOUND)
async def test_what_fuzzing_found_is_a_bad_request_naming_the_field(
    fuzz_stack: FuzzStack, subject: str, body: dict[str, Any], field: str
) -> None:
    before = await fuzz_stack.snapshot()
    raw, _ = await send(fuzz_stack, subject, body)
    error = error_of(raw)
    assert error is not None and error.error.code is ErrorCode.BAD_REQUEST, raw
    assert error.error.field == field
    assert await fuzz_stack.snapshot() == before
