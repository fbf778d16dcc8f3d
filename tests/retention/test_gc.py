"""Retention on a real stack (nats-server, PostgreSQL, recorder, scheduler,
artifact-store, agents, the gateway with the openai SDK): `lorafleet gc`
removes what nothing needs and nothing else, says why and how many bytes,
logs each removal, and does nothing the second time; a job made from a file
while the file is deleted keeps its data whatever the sweep sees between.

The stack runs with no grace (`LORAFLEET_RETENTION_GRACE_S=0`), so these
tests show the order of checks and the touch keeping the race, not the
grace; checkpoints go 1 s after their job ends, and no periodic sweep
runs (each test runs its own)."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import msgspec
import pytest
import pytest_asyncio
from openai import AsyncOpenAI

from lorafleet.errors import ConflictError, NotFoundError
from lorafleet.names import dataset_object_name
from lorafleet.nats.server import NatsServer
from lorafleet.objects import ListedObject, listed_objects, remove_object
from lorafleet.retention._sweep import Judgement, wall_now
from lorafleet.retention.rules import DatasetUse, Policy
from lorafleet_schemas.messages import GcReport, JobRecord, JobState
from lorafleet_services.gateway.api_keys import make_key
from lorafleet_services.recorder import db
from lorafleet_services.recorder.retention import DatasetJudge
from tests.cli.conftest import ROOT, cli_argv
from tests.eventually import eventually
from tests.gateway.conftest import Gateway, engine_process, gateway_on
from tests.pg import throwaway_database
from tests.system.conftest import running_stack, system_settings

pytestmark = pytest.mark.asyncio(loop_scope="module")


def records(tag: str, n: int = 12) -> bytes:
    return "".join(
        json.dumps({"messages": [{"role": "user", "content": f"{tag} {i}?"},
                                 {"role": "assistant", "content": str(i)}]}) + "\n"
        for i in range(n)
    ).encode()  # fmt: skip


CHECKPOINTING_TRAINER = Path(__file__).resolve().parents[1] / "agent" / "checkpointing_trainer.py"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway(
    pg_template: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Gateway]:
    tmp = tmp_path_factory.mktemp("retention")
    nats = NatsServer(tmp / "nats-store")
    await nats.start()
    keys_file = tmp / "keys.json"
    keys = {name: make_key(keys_file, name) for name in ("alice",)}
    try:
        with throwaway_database(template=pg_template) as pg:
            settings = system_settings(nats.url, pg, tmp).with_(
                retention_grace_s=0.0, retention_sweep_every_s=0.0,
                retention_checkpoint_after_s=1.0,
            )  # fmt: skip
            async with (
                running_stack(settings, nats, tmp, "retention-test") as stack,
                engine_process() as engine,
            ):
                await stack.add_model("tiny")
                knobs = {"LORAFLEET_STANDIN_TEST_STEPS": "6", "LORAFLEET_STANDIN_TEST_EVERY": "2"}
                await stack.agent("node-1", env=knobs, trainer=str(CHECKPOINTING_TRAINER))
                env = {"LORAFLEET_GATEWAY_ENGINES": engine.base_url}
                async with gateway_on(stack, keys_file, env) as (proc, url):
                    yield Gateway(stack, engine, proc, url, keys, keys_file)
    finally:
        await nats.stop()


async def lorafleet(g: Gateway, *args: str) -> str:
    """`lorafleet ARGS`, run as a user runs it (a wide terminal's columns); its stdout."""
    env = {**os.environ, **g.stack.settings.to_env(), "COLUMNS": "250"}
    proc = await asyncio.create_subprocess_exec(
        *cli_argv(*args), cwd=ROOT, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    return out.decode()


async def gc(g: Gateway, *args: str) -> list[GcReport]:
    """`lorafleet gc ARGS --json`."""
    return msgspec.json.decode(await lorafleet(g, "gc", *args, "--json"), type=list[GcReport])


async def train(sdk: AsyncOpenAI, data: bytes, delete_file: bool = False) -> tuple[str, str]:
    """A job from a file of `data`, run to success; (its lorafleet id, the file id)."""
    f = await sdk.files.create(file=("t.jsonl", data), purpose="fine-tune")
    job = await sdk.fine_tuning.jobs.create(
        model="tiny", training_file=f.id,
        extra_body={"lorafleet": {"node": "node-1", "gpu_memory_mib": 1000,
                                  "checkpoint_every_steps": 2}},
    )  # fmt: skip
    if delete_file:
        await sdk.files.delete(f.id)
    done = await eventually(
        lambda: sdk.fine_tuning.jobs.retrieve(job.id), f"job {job.id} to end",
        until=lambda j: j.status in ("succeeded", "failed", "cancelled"), timeout_s=60,
    )  # fmt: skip
    assert done.status == "succeeded", done
    return job.id.removeprefix("ftjob-"), f.id


def objects_of(reports: Sequence[GcReport], which: str = "removed") -> dict[str, str]:
    return {i.object: i.reason for r in reports for i in getattr(r, which)}


async def test_gc_takes_what_nothing_needs_and_nothing_else(gateway: Gateway) -> None:
    js, names = gateway.stack.js, gateway.stack.settings.names
    sha = hashlib.sha256
    data, unused = records("kept"), records("unused")
    async with gateway.sdk() as sdk:
        job_id, file_id = await train(sdk, data)
        await sdk.files.delete(file_id)  # the done job still names its data
        spare = await sdk.files.create(file=("u.jsonl", unused), purpose="fine-tune")
        await sdk.files.delete(spare.id)  # nothing names this one now
    await asyncio.sleep(1.1)  # the done job's checkpoint is past its 1 s
    dataset = f"sha256/{sha(unused).hexdigest()}"

    looked = await gc(gateway, "--dry-run")
    assert all(r.dry_run for r in looked)
    would = objects_of(looked)
    assert set(would) == {dataset, f"{job_id}/checkpoint"}, would
    assert "no job and no file names it" in would[dataset]
    assert "checkpoints are kept 1 s after their job ends" in would[f"{job_id}/checkpoint"]
    sizes = {i.object: i.size for r in looked for i in r.removed}
    assert sizes[dataset] == len(unused)
    names_now = {o.name for o in await listed_objects(js, names.datasets_bucket)}
    assert dataset in names_now  # a dry run removes nothing

    done = await gc(gateway)
    assert set(objects_of(done)) == set(would)
    assert sum(r.freed_bytes for r in done) == sum(sizes.values())
    datasets = {o.name for o in await listed_objects(js, names.datasets_bucket)}
    artifacts = {o.name for o in await listed_objects(js, names.artifacts_bucket)}
    assert dataset not in datasets
    assert f"sha256/{sha(data).hexdigest()}" in datasets  # the done job's data
    assert f"{job_id}/peft" in artifacts and f"{job_id}/checkpoint" not in artifacts
    # The recorder forgot it first: a resume says there is none, not a fetch failing.
    record = await gateway.stack.get(job_id)
    assert record.checkpoint is None and record.adapter is not None
    logged = await gateway.stack.recorder.wait_for_event("retention.removed")
    assert (logged["object"], logged["size"]) == (dataset, len(unused))
    assert "no job and no file" in logged["reason"]
    assert gateway.stack.artifact_store is not None
    logged = await gateway.stack.artifact_store.wait_for_event("retention.removed")
    assert (logged["object"], logged["job_id"]) == (f"{job_id}/checkpoint", job_id)

    again = await gc(gateway)
    assert objects_of(again) == {} and sum(r.freed_bytes for r in again) == 0
    logged = await gateway.proc.wait_for_event("gateway.file_deleted")
    assert logged["file_id"] == spare.id


async def test_gc_for_a_person_says_what_and_how_much(gateway: Gateway) -> None:
    async with gateway.sdk() as sdk:
        spare = await sdk.files.create(file=("p.jsonl", records("person")), purpose="fine-tune")
        await sdk.files.delete(spare.id)
    out = await lorafleet(gateway, "gc", "--dry-run")
    size = len(records("person"))
    assert f"would remove 1 objects ({size / 1024:.1f} KiB); 0 in their grace;" in out, out
    assert "no job and no file names it" in out, out
    await gc(gateway)


async def test_a_job_made_from_a_file_being_deleted_keeps_its_data(gateway: Gateway) -> None:
    """The sweep reads the gateway's files, and only then the jobs: a job
    created from a file that is deleted between the two reads is seen."""
    stack = gateway.stack
    data = records("raced")
    dataset = f"sha256/{hashlib.sha256(data).hexdigest()}"
    made: list[str] = []
    # A job in the table: a sweep over a table with none removes nothing at all.
    other = await stack.submit(node="node-1")
    async with gateway.sdk() as sdk:
        f = await sdk.files.create(file=("r.jsonl", data), purpose="fine-tune")

        async def race() -> None:
            """Between the sweep's two reads, whichever comes first: the job is
            made from the file, then the file is deleted (OpenAI's clients do
            both at once)."""
            if made:
                return
            job = await sdk.fine_tuning.jobs.create(
                model="tiny", training_file=f.id,
                extra_body={"lorafleet": {"node": "node-1", "gpu_memory_mib": 1000}},
            )  # fmt: skip
            made.append(job.id)
            await sdk.files.delete(f.id)

        class Racing(DatasetJudge):
            async def files(self) -> dict[str, str]:
                seen = await super().files()
                await race()
                return seen

            async def uses(self) -> tuple[dict[str, DatasetUse], int]:
                seen = await super().uses()
                await race()
                return seen

        engine = db.create_engine(stack.settings.effective_database_url)
        try:
            judge = Racing(stack.js, stack.settings.names, db.sessions(engine), Policy(), wall_now)
            listed: Sequence[ListedObject] = await listed_objects(
                stack.js, stack.settings.names.datasets_bucket
            )
            judged: Judgement = await judge(listed)
        finally:
            await engine.dispose()
        assert made and not judged.refused
        assert dataset not in {u.obj.name for u in judged.unneeded}
        job = await eventually(
            lambda: sdk.fine_tuning.jobs.retrieve(made[0]), "the raced job to end",
            until=lambda j: j.status in ("succeeded", "failed"), timeout_s=60,
        )  # fmt: skip
        assert job.status == "succeeded", job
    await stack.wait_state(other.id, JobState.DONE)


async def test_a_submit_naming_a_dataset_keeps_it_from_a_sweep_that_judged_it(
    gateway: Gateway,
) -> None:
    """The recorder touches a dataset a submit names before it writes the job:
    a sweep that listed it before cannot remove it after."""
    stack, bucket = gateway.stack, gateway.stack.settings.names.datasets_bucket
    data = records("named")
    name = dataset_object_name(hashlib.sha256(data).hexdigest())
    await (await stack.js.object_store(bucket)).put(name, io.BytesIO(data))
    [judged] = [o for o in await listed_objects(stack.js, bucket) if o.name == name]
    job = await stack.submit(node="node-1", data=None, dataset=name)
    assert not await remove_object(stack.js, bucket, judged)
    assert name in {o.name for o in await listed_objects(stack.js, bucket)}
    assert (await stack.wait_state(job.id, JobState.DONE, JobState.FAILED)).state is JobState.DONE


async def test_a_deleted_jobs_artifacts_and_data_go(gateway: Gateway) -> None:
    stack = gateway.stack
    data = records("deleted")
    job = await stack.submit(node="node-1", data=data.decode())
    assert (await stack.wait_state(job.id, JobState.DONE, JobState.FAILED)).state is JobState.DONE
    # Training's end drops a checkpoint still on its way (agent/transfer/
    # checkpoints.py): a fast run may store none (a suite run on a quiet
    # machine did). Whatever was stored must go.
    stored = (await stack.get(job.id)).checkpoint
    dataset = dataset_object_name(hashlib.sha256(data).hexdigest())
    deleted = msgspec.json.decode(
        await lorafleet(gateway, "jobs", "delete", job.id, "--reason", "a test", "--json"),
        type=JobRecord,
    )  # fmt: skip
    assert deleted.id == job.id
    assert (await stack.recorder.wait_for_event("job.deleted"))["job_id"] == job.id
    with pytest.raises(NotFoundError):
        await stack.get(job.id)
    removed = objects_of(await gc(gateway))
    assert removed[f"{job.id}/peft"] == f"job {job.id} is not in the recorder (deleted)"
    assert "no job and no file names it" in removed[dataset]
    assert (f"{job.id}/checkpoint" in removed) is (stored is not None), (stored, removed)


async def test_a_job_deleted_in_lorafleet_leaves_the_gateways_listing(gateway: Gateway) -> None:
    async with gateway.sdk() as sdk:
        job_id, _ = await train(sdk, records("listed"))
        await lorafleet(gateway, "jobs", "delete", job_id)
        listed = [j.id async for j in sdk.fine_tuning.jobs.list()]
        assert f"ftjob-{job_id}" not in listed  # and no 404 for the listing


async def test_an_active_job_cannot_be_deleted(gateway: Gateway) -> None:
    stack = gateway.stack
    job = await stack.submit(node="node-none")  # no such node: queued for ever
    with pytest.raises(ConflictError, match="is queued: cancel it first"):
        await stack.call(stack.settings.names.jobs_delete, {"id": job.id})
    await stack.cancel(job.id)
    await stack.call(stack.settings.names.jobs_delete, {"id": job.id})


async def test_an_active_jobs_checkpoint_is_kept(gateway: Gateway) -> None:
    stack = gateway.stack
    knobs = {"LORAFLEET_STANDIN_TEST_STEPS": "400", "LORAFLEET_STANDIN_TEST_STEP_S": "0.05",
             "LORAFLEET_STANDIN_TEST_EVERY": "2"}  # fmt: skip
    await stack.agent("node-slow", env=knobs, trainer=str(CHECKPOINTING_TRAINER))
    job = await stack.submit(node="node-slow", params={"checkpoint_every_steps": 2})
    await eventually(
        lambda: stack.get(job.id), "a checkpoint stored",
        until=lambda j: j.checkpoint is not None, timeout_s=30,
    )  # fmt: skip
    await asyncio.sleep(1.1)  # past the checkpoints' 1 s: only its being active keeps it
    reports = await gc(gateway)
    assert f"{job.id}/checkpoint" not in objects_of(reports)
    assert (await stack.get(job.id)).state is JobState.RUNNING
    # The recorder's own check, as the artifact-store asks before a removal: an
    # active job's checkpoint is needed (a job resumed since a sweep judged it).
    forget = {"id": job.id, "kind": "checkpoint", "size": 1, "sha256": "0" * 64, "removed": True}
    with pytest.raises(ConflictError, match="is running: its checkpoint is needed"):
        await stack.call(stack.settings.names.store_artifact, forget)
    assert (await stack.get(job.id)).checkpoint is not None
    await stack.cancel(job.id)
    await stack.wait_state(job.id, JobState.CANCELLED)
