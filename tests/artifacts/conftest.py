"""Fixtures for the artifact tests: a connection with the lorafleet layout, the
recorder as a real process, jobs set up as if the scheduler had dispatched them,
the chunks an agent would publish, and what the streams hold afterwards."""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client

from lorafleet.artifacts import AsyncPublisher, download_artifact, get_record
from lorafleet.names import Header, Names, chunk_msg_id, object_meta_subjects, object_stream
from lorafleet.nats._bus import connect, decode, drain_quietly, ensure_layout, layout_for
from lorafleet.settings import Settings
from lorafleet_schemas.messages import ArtifactChunkHeader, ArtifactKind, JobRecord
from lorafleet_services.agent.transfer.delivery import deliver
from tests.procs import ServiceProcess

NAMES = Names()
QA = '{"q": "2+2?", "a": "4"}\n{"q": "3+3?", "a": "6"}\n'


@pytest.fixture
async def nc(settings: Settings) -> AsyncIterator[Client]:
    client = await connect(settings, "test-artifacts")
    await ensure_layout(client.jetstream(), layout_for(settings))
    try:
        yield client
    finally:
        await drain_quietly(client)


@pytest.fixture
async def publisher(nc: Client) -> AsyncIterator[AsyncPublisher]:
    async with AsyncPublisher(nc) as p:
        yield p


@pytest.fixture
async def recorder(settings: Settings, pg_url: str) -> AsyncIterator[ServiceProcess]:
    proc = ServiceProcess("lorafleet_services.recorder", settings.with_(database_url=pg_url))
    await proc.start()
    try:
        yield proc
    finally:
        await proc.stop()


async def api(nc: Client, subject: str, body: dict[str, Any]) -> dict[str, Any]:
    msg = await nc.request(subject, json.dumps(body).encode(), timeout=10)
    out: dict[str, Any] = json.loads(msg.data)
    assert "error" not in out, out
    return out


async def get_job(nc: Client, names: Names, job_id: str) -> JobRecord:
    got = await nc.request(names.jobs_get, json.dumps({"id": job_id}).encode(), timeout=10)
    return decode(got.data, JobRecord)


async def dispatched_job(
    nc: Client, names: Names, *, node: str = "n1", engine: str = "llamacpp"
) -> JobRecord:
    """A job on `node`, uploading (as the scheduler and the agent would leave it)."""
    model = f"tiny-{engine}"
    listed = await api(nc, names.models_list, {})
    if model not in {m["name"] for m in listed["models"]}:
        await api(nc, names.models_add, {"name": model, "engine": engine, "hf_repo": "org/tiny"})
    job = await api(nc, names.jobs_submit, {"model": model, "gpu_memory_mib": 1, "data": QA})
    for frm, to, extra in (("queued", "starting", {"node": node}), ("starting", "uploading", {})):
        body = {"id": job["id"], "from_state": frm, "to_state": to, **extra}
        moved = await api(nc, names.store_transition, body)
        assert moved["applied"], moved
    return await get_job(nc, names, job["id"])


def chunks_of(
    job: JobRecord,
    kind: ArtifactKind,
    data: bytes,
    step: int,
    *,
    node: str | None = None,
    sha256: str | None = None,
    checkpoint_step: int | None = None,
) -> list[tuple[dict[str, str], bytes]]:
    """The messages an agent would publish for `data`, as (headers, body);
    `checkpoint_step`: a checkpoint's step (header and message id)."""
    node = node or job.node or ""
    bodies = [data[i : i + step] for i in range(0, len(data), step)] or [b""]
    out = []
    for seq, body in enumerate(bodies):
        h = ArtifactChunkHeader(
            job_id=job.id, node=node, kind=kind, attempt=job.attempt, seq=seq,
            step=checkpoint_step,
        )  # fmt: skip
        if seq == len(bodies) - 1:
            h = msgspec.structs.replace(
                h,
                last=True,
                count=len(bodies),
                size=len(data),
                sha256=sha256 or hashlib.sha256(data).hexdigest(),
            )
        headers = {
            Header.MSG_ID: chunk_msg_id(job.id, kind.value, job.attempt, seq, checkpoint_step),
            Header.CHUNK: msgspec.json.encode(h).decode(),
        }
        out.append((headers, body))
    return out


async def publish(
    nc: Client,
    job: JobRecord,
    kind: ArtifactKind,
    msgs: list[tuple[dict[str, str], bytes]],
    node: str | None = None,
) -> None:
    js = nc.jetstream()
    subject = NAMES.artifact_chunks(node or job.node or "", job.id, kind.value)
    for headers, body in msgs:
        await js.publish(subject, body, headers=dict(headers))


async def stored(nc: Client, job_id: str, kind: ArtifactKind) -> bool:
    return await get_record(nc.jetstream(), NAMES, job_id, kind.value) is not None


async def artifacts_stream_empty(nc: Client) -> bool:
    info = await nc.jetstream().stream_info(NAMES.artifacts_stream)
    return info.state.messages == 0


async def object_chunks(nc: Client) -> int:
    info = await nc.jetstream().stream_info(object_stream(NAMES.artifacts_bucket))
    return info.state.messages


async def download(nc: Client, job_id: str, kind: ArtifactKind, tmp_path: Path) -> bytes:
    out = tmp_path / f"dl-{job_id}-{kind.value}"
    rec = await download_artifact(nc.jetstream(), NAMES, job_id, kind, out)
    data = out.read_bytes()
    assert rec.sha256 == hashlib.sha256(data).hexdigest()
    return data


async def deliver_file(
    nc: Client,
    job: JobRecord,
    kind: ArtifactKind,
    path: Path,
    *,
    node: str | None = None,
    attempt: int | None = None,
    chunk_bytes: int | None = None,
    step: int | None = None,
) -> tuple[int, str]:
    """`path` delivered as the agent delivers it (`agent.delivery.deliver`): from
    the job's node and attempt unless told otherwise; returns (size, sha256)."""
    return await deliver(
        nc.jetstream(),
        NAMES,
        node=node or job.node or "",
        job_id=job.id,
        attempt=job.attempt if attempt is None else attempt,
        kind=kind,
        path=path,
        step=step,
        **({} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}),
    )


def under_new_ids(
    msgs: list[tuple[dict[str, str], bytes]],
) -> list[tuple[dict[str, str], bytes]]:
    """The same chunks with new message ids (the stream would drop repeats), as
    an agent's redelivery or a retry would publish them."""
    return [({**h, Header.MSG_ID: h[Header.MSG_ID] + ".again"}, b) for h, b in msgs]


async def last_info_seq(nc: Client) -> int:
    """The stream sequence of the newest object info message."""
    bucket = NAMES.artifacts_bucket
    raw = await nc.jetstream().get_last_msg(object_stream(bucket), object_meta_subjects(bucket))
    return raw.seq or 0
