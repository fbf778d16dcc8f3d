"""A job runs to `done` with every process on its own nkey identity
(`lorafleet auth`'s config), and nothing is refused on the way but the
agent's attempt to create the layout."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import pytest

from lorafleet.artifacts import file_sha256
from lorafleet.errors import ConflictError
from lorafleet.names import dataset_object_name
from lorafleet_schemas.messages import Engine, JobSpec, JobState, ModelSpec
from tests.permissions.conftest import IdentityFleet
from tests.permissions.flow import DATA, identity_system


async def test_a_job_ends_done_with_every_process_on_its_own_identity(
    id_fleet: IdentityFleet, tmp_path: Path, sqlite_url: str
) -> None:
    async with identity_system(id_fleet, tmp_path, sqlite_url) as system:
        job, out = await system.run_job(tmp_path)
        assert job.state is JobState.DONE, job
        assert out.stat().st_size > 0
        listed = await system.client.artifacts(job.id)
        assert file_sha256(out) == next(a.sha256 for a in listed if a.kind.value == "peft")
        # Retention on the owners' identities: the recorder reads the jobs and
        # (no gateway here) finds no files; the artifact-store asks the recorder.
        reports = await system.client.gc(dry_run=True)
        assert [r.refused for r in reports] == ["", ""] and all(r.examined for r in reports)
        assert [i.object for r in reports for i in r.removed] == []
        assert system.refusals() == {}, system.refusals()
    # The server refused one thing only: the agent's attempt to create the layout.
    refused = id_fleet.server_refusals()
    assert refused, "the agent's layout attempt should have been refused"
    assert all("lorafleet-agent-node-1" in line and "STREAM.CREATE" in line for line in refused)


async def test_a_dataset_overwritten_by_a_client_is_refused_at_submit(
    id_fleet: IdentityFleet, tmp_path: Path, sqlite_url: str
) -> None:
    """A client may put datasets, so it may put other bytes under another's
    `sha256/<hex>` name; the recorder reads what it names and refuses it."""
    async with identity_system(id_fleet, tmp_path, sqlite_url) as system:
        c = system.client
        base = tmp_path / "models" / "tiny"
        base.mkdir(parents=True)
        await c.add_model(ModelSpec(name="tiny", engine=Engine.VLLM, local_dir=str(base)))
        name = dataset_object_name(hashlib.sha256(DATA.encode()).hexdigest())
        forged = DATA.replace("what", "WHAT").encode()  # same size, other bytes
        store = await c.js.object_store(id_fleet.base.names.datasets_bucket)
        await store.put(name, io.BytesIO(forged))
        assert await c.upload_dataset(DATA.encode()) == name  # found by name: not put again
        with pytest.raises(ConflictError, match=r"holds data whose sha256 is [0-9a-f]{64}, not"):
            await c.submit(JobSpec(model="tiny", gpu_memory_mib=1000, dataset=name, node="node-1"))
        assert system.refusals() == {}, system.refusals()
