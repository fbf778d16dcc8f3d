"""A job runs to `done` with every process on its own nkey identity
(`lorafleet auth`'s config), and nothing is refused on the way but the
agent's attempt to create the layout."""

from __future__ import annotations

from pathlib import Path

from lorafleet.artifacts import file_sha256
from lorafleet_schemas.messages import JobState
from tests.permissions.conftest import IdentityFleet
from tests.permissions.flow import identity_system


async def test_a_job_ends_done_with_every_process_on_its_own_identity(
    id_fleet: IdentityFleet, tmp_path: Path, sqlite_url: str
) -> None:
    async with identity_system(id_fleet, tmp_path, sqlite_url) as system:
        job, out = await system.run_job(tmp_path)
        assert job.state is JobState.DONE, job
        assert out.stat().st_size > 0
        listed = await system.client.artifacts(job.id)
        assert file_sha256(out) == next(a.sha256 for a in listed if a.kind.value == "peft")
        assert system.refusals() == {}, system.refusals()
    # The server refused one thing only: the agent's attempt to create the layout.
    refused = id_fleet.server_refusals()
    assert refused, "the agent's layout attempt should have been refused"
    assert all("lorafleet-agent-node-1" in line and "STREAM.CREATE" in line for line in refused)
