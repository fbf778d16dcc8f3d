"""The artifact-store with a real nats-server, a real recorder process and PostgreSQL."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client

from lorafleet.names import Header, Names
from lorafleet.nats._bus import connect, drain_quietly
from lorafleet.settings import Settings
from lorafleet_schemas.messages import ArtifactKind, JobRecord, JobState
from lorafleet_services.artifact_store.service import ArtifactStore
from tests.artifacts.conftest import (
    api,
    artifacts_stream_empty,
    chunks_of,
    deliver_file,
    dispatched_job,
    download,
    get_job,
    last_info_seq,
    object_chunks,
    publish,
    stored,
    under_new_ids,
)
from tests.eventually import eventually
from tests.procs import ServiceProcess

N = Names()
#: Seconds each wait of these tests lasts at most.
WAIT_S = 20.0
#: Seconds without a chunk before a store of the idle tests checks a delivery again.
QUICK_IDLE_S = 0.5


async def until_state(nc: Client, job_id: str, state: JobState, what: str) -> JobRecord:
    """The job, once the recorder holds it in `state` (at most WAIT_S)."""
    return await eventually(
        lambda: get_job(nc, N, job_id), what, until=lambda j: j.state is state, timeout_s=WAIT_S
    )


@contextlib.asynccontextmanager
async def running_store(
    settings: Settings, name: str = "artifact-store", **kwargs: Any
) -> AsyncIterator[ArtifactStore]:
    """An ArtifactStore in this process on its own connection, started; stopped after."""
    client = await connect(settings, name)
    s = ArtifactStore(client, settings, **kwargs)
    await s.start()
    try:
        yield s
    finally:
        await s.stop()
        await drain_quietly(client)


@pytest.fixture
async def store(settings: Settings, recorder: ServiceProcess) -> AsyncIterator[ArtifactStore]:
    async with running_store(settings) as s:
        yield s


@pytest.fixture
async def quick_idle_store(
    settings: Settings, recorder: ServiceProcess
) -> AsyncIterator[ArtifactStore]:
    """A store that checks an open delivery after 0.5 s without a chunk (not 60)."""
    async with running_store(settings, idle_check_s=QUICK_IDLE_S) as s:
        yield s


async def test_end_to_end_both_artifacts_make_the_job_done(
    nc: Client, store: ArtifactStore, tmp_path: Path
) -> None:
    job = await dispatched_job(nc, N, engine="llamacpp")
    assert job.artifacts_expected == [ArtifactKind.PEFT, ArtifactKind.GGUF]
    rng = random.Random(11)
    peft = tmp_path / "adapter.tar.gz"
    peft.write_bytes(rng.randbytes(5 * 1024 * 1024 + 4321))
    gguf = tmp_path / "adapter.gguf"
    gguf.write_bytes(rng.randbytes(3 * 1024 * 1024 + 7))
    size, sha = await deliver_file(nc, job, ArtifactKind.PEFT, peft, chunk_bytes=256 * 1024)
    await eventually(
        lambda: stored(nc, job.id, ArtifactKind.PEFT), "the peft artifact", timeout_s=WAIT_S
    )
    # One of two expected artifacts: not done. The recorder hears of it after
    # the object is committed (and readable), so that is waited for too.
    await eventually(
        lambda: get_job(nc, N, job.id),
        "the recorder to list the peft artifact as stored",
        until=lambda j: j.artifacts_stored == [ArtifactKind.PEFT],
        timeout_s=WAIT_S,
    )
    assert (await get_job(nc, N, job.id)).state is JobState.UPLOADING

    got = await api(nc, N.artifacts_get, {"job_id": job.id, "kind": "peft"})
    assert (got["size"], got["sha256"], got["object"]) == (size, sha, f"{job.id}/peft")
    assert (got["node"], got["base_model"], got["job_id"]) == ("n1", "tiny-llamacpp", job.id)
    assert await download(nc, job.id, ArtifactKind.PEFT, tmp_path) == peft.read_bytes()

    await deliver_file(nc, job, ArtifactKind.GGUF, gguf, chunk_bytes=256 * 1024)

    await until_state(nc, job.id, JobState.DONE, "the job to be done")
    listed = await api(nc, N.artifacts_list, {"job_id": job.id})
    assert [(a["kind"], a["size"]) for a in listed["artifacts"]] == [
        ("peft", peft.stat().st_size),
        ("gguf", gguf.stat().st_size),
    ]
    assert await download(nc, job.id, ArtifactKind.GGUF, tmp_path) == gguf.read_bytes()
    # The delivered chunks are gone from the stream once committed.
    await eventually(
        lambda: artifacts_stream_empty(nc), "the chunks to be purged", timeout_s=WAIT_S
    )
    missing = await nc.request(
        N.artifacts_get, json.dumps({"job_id": "nope", "kind": "gguf"}).encode()
    )
    assert json.loads(missing.data)["error"]["code"] == "not_found"


async def test_duplicated_and_reordered_chunks_store_the_exact_bytes(
    nc: Client, store: ArtifactStore, tmp_path: Path
) -> None:
    job = await dispatched_job(nc, N, engine="vllm")
    data = random.Random(12).randbytes(40 * 1000 + 17)
    msgs = chunks_of(job, ArtifactKind.PEFT, data, 1000)
    body = msgs[:-1]
    rng = random.Random(13)
    shuffled = body + rng.sample(body, 10)
    rng.shuffle(shuffled)
    # Different message ids, so the stream keeps the duplicates (as after a redelivery).
    dupes = under_new_ids(body[:5])
    await publish(nc, job, ArtifactKind.PEFT, shuffled + dupes + [msgs[-1]] + body[:3])

    await until_state(nc, job.id, JobState.DONE, "the job to be done")
    assert await download(nc, job.id, ArtifactKind.PEFT, tmp_path) == data


@pytest.mark.parametrize("fault", ["sha256", "missing", "beyond"])
async def test_a_corrupt_or_short_delivery_fails_the_job_and_stores_nothing(
    nc: Client, store: ArtifactStore, fault: str
) -> None:
    job = await dispatched_job(nc, N, engine="vllm")
    data = random.Random(14).randbytes(20_000)
    if fault == "sha256":
        msgs = chunks_of(job, ArtifactKind.PEFT, data, 1000, sha256="ab" * 32)
    elif fault == "missing":
        msgs = chunks_of(job, ArtifactKind.PEFT, data, 1000)
        del msgs[7]
    else:
        msgs = chunks_of(job, ArtifactKind.PEFT, data, 1000)
        h = json.loads(msgs[0][0][Header.CHUNK])
        extra = {Header.CHUNK: json.dumps({**h, "seq": 23}), Header.MSG_ID: "extra"}
        msgs.insert(5, (extra, b"x" * 1000))
    await publish(nc, job, ArtifactKind.PEFT, msgs)

    await until_state(nc, job.id, JobState.FAILED, "the job to fail")
    message = (await get_job(nc, N, job.id)).message
    assert "peft artifact of job" in message
    if fault == "sha256":
        assert "corrupt: its sha256 is" in message and "ab" * 32 in message
    elif fault == "missing":
        assert "short: 1 of its 20 chunks never arrived (chunk 7)" in message
    else:
        assert "chunk 23 is beyond the count 20" in message
    assert not await stored(nc, job.id, ArtifactKind.PEFT)
    assert await object_chunks(nc) == 0
    await eventually(
        lambda: artifacts_stream_empty(nc), "the chunks to be purged", timeout_s=WAIT_S
    )


async def test_a_node_delivering_for_another_nodes_job_is_refused(
    nc: Client, store: ArtifactStore, tmp_path: Path
) -> None:
    job = await dispatched_job(nc, N, node="n1", engine="vllm")
    path = tmp_path / "x"
    path.write_bytes(random.Random(15).randbytes(100_000))
    await deliver_file(nc, job, ArtifactKind.PEFT, path, node="intruder", chunk_bytes=10_000)
    await eventually(
        lambda: artifacts_stream_empty(nc), "the refused chunks to be purged", timeout_s=WAIT_S
    )
    assert not await stored(nc, job.id, ArtifactKind.PEFT)
    assert await object_chunks(nc) == 0
    after = await get_job(nc, N, job.id)
    assert after.state is JobState.UPLOADING and after.artifacts_stored == []
    # A stale attempt of the right node is refused too.
    stale = job.attempt + 5
    await deliver_file(nc, job, ArtifactKind.PEFT, path, attempt=stale, chunk_bytes=10_000)
    await eventually(
        lambda: artifacts_stream_empty(nc), "the stale chunks to be purged", timeout_s=WAIT_S
    )
    assert not await stored(nc, job.id, ArtifactKind.PEFT)


async def test_store_killed_mid_delivery_stores_the_exact_artifact(
    nc: Client, settings: Settings, recorder: ServiceProcess, tmp_path: Path
) -> None:
    job = await dispatched_job(nc, N, engine="vllm")
    data = random.Random(16).randbytes(6 * 1024 * 1024 + 99)
    msgs = chunks_of(job, ArtifactKind.PEFT, data, 64 * 1024)
    half = len(msgs) // 2
    js = nc.jetstream()
    proc = await ServiceProcess("lorafleet_services.artifact_store", settings).start()
    try:
        await publish(nc, job, ArtifactKind.PEFT, msgs[:half])

        async def half_taken() -> bool:
            info = await js.consumer_info(N.artifacts_stream, N.artifact_store_consumer)
            return info.ack_floor.stream_seq >= half and await object_chunks(nc) >= half

        # The store has taken (acknowledged, and written into the object's chunks)
        # the first half when it dies.
        await eventually(half_taken, "the store to take the first half", timeout_s=WAIT_S)
        proc.kill()
        await proc.stop()
        await publish(nc, job, ArtifactKind.PEFT, msgs[half:])
        # Leftovers of the dead store are swept at start (at once, here).
        sweeping = settings.with_(artifact_orphan_age_s=0.0)
        proc = await ServiceProcess("lorafleet_services.artifact_store", sweeping).start()
        await eventually(
            lambda: stored(nc, job.id, ArtifactKind.PEFT),
            "the artifact after restart",
            timeout_s=WAIT_S,
        )
        event = await proc.wait_for_event("artifact.stored")
        assert event["sha256"] == hashlib.sha256(data).hexdigest()
        assert event["size"] == len(data)
    finally:
        await proc.stop()
    assert await download(nc, job.id, ArtifactKind.PEFT, tmp_path) == data
    assert (await get_job(nc, N, job.id)).state is JobState.DONE
    # Only the committed object's chunks are left in the object store.
    assert await object_chunks(nc) == len(msgs) + 1


async def test_concurrent_deliveries_are_kept_apart(
    nc: Client, store: ArtifactStore, tmp_path: Path
) -> None:
    jobs = [await dispatched_job(nc, N, node=f"n{i}", engine="vllm") for i in range(3)]
    paths = []
    for i in range(len(jobs)):
        p = tmp_path / f"a{i}"
        p.write_bytes(random.Random(20 + i).randbytes(1_500_000 + i))
        paths.append(p)
    await asyncio.gather(
        *(
            deliver_file(nc, job, ArtifactKind.PEFT, p, chunk_bytes=32 * 1024)
            for job, p in zip(jobs, paths, strict=True)
        )
    )
    for job, p in zip(jobs, paths, strict=True):

        async def done(job_id: str = job.id) -> bool:
            return await stored(nc, job_id, ArtifactKind.PEFT)

        await eventually(done, f"job {job.id}", timeout_s=WAIT_S)
        assert await download(nc, job.id, ArtifactKind.PEFT, tmp_path) == p.read_bytes()


async def test_restart_after_commit_before_purge_keeps_the_object(
    nc: Client, settings: Settings, recorder: ServiceProcess, tmp_path: Path
) -> None:
    """A store that died after committing, before purging the chunks: the next
    one finds the object, leaves it as it is and purges the chunks."""
    # Two artifacts expected, so the job is still uploading after the first.
    job = await dispatched_job(nc, N, engine="llamacpp")
    data = random.Random(30).randbytes(300_000)
    msgs = chunks_of(job, ArtifactKind.PEFT, data, 50_000)
    async with running_store(settings):
        await publish(nc, job, ArtifactKind.PEFT, msgs)
        await eventually(
            lambda: stored(nc, job.id, ArtifactKind.PEFT), "the artifact", timeout_s=WAIT_S
        )
        await eventually(
            lambda: artifacts_stream_empty(nc), "the chunks to be purged", timeout_s=WAIT_S
        )
    info_before = await last_info_seq(nc)
    chunks_before = await object_chunks(nc)
    # The chunks as they were before the purge (new ids: the stream would drop repeats).
    again = under_new_ids(msgs)
    await publish(nc, job, ArtifactKind.PEFT, again)
    async with running_store(settings):
        await eventually(
            lambda: artifacts_stream_empty(nc), "the leftover chunks to be purged", timeout_s=WAIT_S
        )
    assert await last_info_seq(nc) == info_before  # not committed a second time
    assert await object_chunks(nc) == chunks_before
    assert await download(nc, job.id, ArtifactKind.PEFT, tmp_path) == data
    after = await get_job(nc, N, job.id)
    assert after.state is JobState.UPLOADING and after.artifacts_stored == [ArtifactKind.PEFT]


async def test_an_abandoned_delivery_is_cleaned_up_once_its_job_is_over(
    nc: Client, quick_idle_store: ArtifactStore
) -> None:
    job = await dispatched_job(nc, N, engine="vllm")
    msgs = chunks_of(job, ArtifactKind.PEFT, random.Random(40).randbytes(100_000), 10_000)
    await publish(nc, job, ArtifactKind.PEFT, msgs[:4])  # the agent died here

    async def written() -> bool:
        return await object_chunks(nc) == 4

    await eventually(written, "the first chunks to be written", timeout_s=WAIT_S)
    body = {"id": job.id, "from_state": "uploading", "to_state": "failed", "message": "node lost"}
    await api(nc, N.store_transition, body)
    await eventually(
        lambda: artifacts_stream_empty(nc), "the abandoned chunks to be purged", timeout_s=WAIT_S
    )
    assert await object_chunks(nc) == 0
    assert not await stored(nc, job.id, ArtifactKind.PEFT)


async def test_two_replicas_share_the_work_and_store_each_artifact_exactly(
    nc: Client,
    settings: Settings,
    recorder: ServiceProcess,
    tmp_path: Path,
) -> None:
    async with contextlib.AsyncExitStack() as replicas:
        for i in range(2):
            name = f"artifact-store-{i}"
            await replicas.enter_async_context(
                running_store(settings, name, idle_check_s=QUICK_IDLE_S)
            )
        jobs = [await dispatched_job(nc, N, node=f"n{i}", engine="vllm") for i in range(3)]
        datas = [random.Random(50 + i).randbytes(2_000_000 + i) for i in range(3)]
        for job, data in zip(jobs, datas, strict=True):
            p = tmp_path / f"r-{job.id}"
            p.write_bytes(data)
            await deliver_file(nc, job, ArtifactKind.PEFT, p, chunk_bytes=64 * 1024)
        for job, data in zip(jobs, datas, strict=True):
            await until_state(nc, job.id, JobState.DONE, f"job {job.id} done")
            assert await download(nc, job.id, ArtifactKind.PEFT, tmp_path) == data
        expected = sum(-(-len(d) // (64 * 1024)) for d in datas) + len(datas)

        async def only_committed_chunks() -> bool:
            return await object_chunks(nc) == expected

        # A replica that saw part of a delivery the other committed gives its copy up.
        await eventually(
            only_committed_chunks, "the replicas' partial copies to be given up", timeout_s=WAIT_S
        )
        await eventually(
            lambda: artifacts_stream_empty(nc), "the chunks to be purged", timeout_s=WAIT_S
        )


async def test_a_zero_byte_artifact_is_stored_and_downloads(
    nc: Client, store: ArtifactStore, tmp_path: Path
) -> None:
    job = await dispatched_job(nc, N, engine="vllm")
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    await deliver_file(nc, job, ArtifactKind.PEFT, empty)

    await until_state(nc, job.id, JobState.DONE, "the job to be done")
    got = await api(nc, N.artifacts_get, {"job_id": job.id, "kind": "peft"})
    assert (got["size"], got["sha256"]) == (0, hashlib.sha256(b"").hexdigest())
    assert await download(nc, job.id, ArtifactKind.PEFT, tmp_path) == b""


# --- checkpoints ------------------------------------------------------------------

CKPT = ArtifactKind.CHECKPOINT


async def running_job(nc: Client) -> JobRecord:
    """A vLLM job (it makes peft only) on n1, running, as the scheduler and the
    agent would leave it."""
    listed = await api(nc, N.models_list, {})
    if "tiny-vllm" not in {m["name"] for m in listed["models"]}:
        await api(nc, N.models_add, {"name": "tiny-vllm", "engine": "vllm", "hf_repo": "org/t"})
    data = '{"q": "2+2?", "a": "4"}\n'
    job = await api(nc, N.jobs_submit, {"model": "tiny-vllm", "gpu_memory_mib": 1, "data": data})
    for frm, to, extra in (("queued", "starting", {"node": "n1"}), ("starting", "running", {})):
        body = {"id": job["id"], "from_state": frm, "to_state": to, **extra}
        assert (await api(nc, N.store_transition, body))["applied"]
    return await get_job(nc, N, job["id"])


async def checkpoint_sha(nc: Client, job_id: str) -> str | None:
    """The stored checkpoint's sha256 (api.artifacts.get); None while there is none."""
    body = json.dumps({"job_id": job_id, "kind": "checkpoint"}).encode()
    got = json.loads((await nc.request(N.artifacts_get, body, timeout=5)).data)
    return None if "error" in got else str(got["sha256"])


async def test_checkpoints_while_running_keep_the_newest_and_never_finish_the_job(
    nc: Client, store: ArtifactStore, tmp_path: Path
) -> None:
    job = await running_job(nc)
    assert job.artifacts_expected == [ArtifactKind.PEFT]
    rng = random.Random(21)
    shas = {}
    for step in (5, 10):
        path = tmp_path / f"ck-{step}.tar"
        path.write_bytes(rng.randbytes(300_000 + step))
        shas[step] = hashlib.sha256(path.read_bytes()).hexdigest()
        await deliver_file(nc, job, CKPT, path, chunk_bytes=64 * 1024, step=step)
        await eventually(
            lambda: checkpoint_sha(nc, job.id),
            f"the checkpoint at step {step} to be stored",
            until=lambda sha, want=shas[step]: sha == want,
            timeout_s=WAIT_S,
        )
    assert await download(nc, job.id, CKPT, tmp_path) == (tmp_path / "ck-10.tar").read_bytes()
    # Only the newest is kept: its 5 chunks and its info. The older one's
    # chunks are purged after the newer one's info is committed (and so
    # readable), so this is waited for, not read once.
    await eventually(
        lambda: object_chunks(nc),
        "only the newest checkpoint's chunks and info to be kept",
        until=lambda n: n == 5 + 1,
        timeout_s=WAIT_S,
    )
    now = await get_job(nc, N, job.id)
    assert now.state is JobState.RUNNING and now.artifacts_stored == []
    if now.checkpoint is not None:  # a recorder that keeps it (JobRecord.checkpoint)
        assert (now.checkpoint.step, now.checkpoint.sha256) == (10, shas[10])

    # The adapter alone finishes the job; the checkpoint is listed beside it.
    moved = await api(
        nc, N.store_transition, {"id": job.id, "from_state": "running", "to_state": "uploading"}
    )
    assert moved["applied"]
    peft = tmp_path / "adapter.tar.gz"
    peft.write_bytes(rng.randbytes(10_000))
    await deliver_file(nc, job, ArtifactKind.PEFT, peft)
    done = await until_state(nc, job.id, JobState.DONE, "the job to be done")
    assert done.artifacts_stored == [ArtifactKind.PEFT]
    listed = await api(nc, N.artifacts_list, {"job_id": job.id})
    assert [a["kind"] for a in listed["artifacts"]] == ["peft", "checkpoint"]
