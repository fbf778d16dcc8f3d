"""compose/: the NATS config compose mounts boots, here, as a real
three-server cluster whose users are what `lorafleet auth` writes (the
`include ./authorization.conf` beside it, as compose mounts it), and a job
runs to done on it with every process on its own identity."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lorafleet.access.identities import IdentityStore
from lorafleet.nats.cluster import NatsCluster
from lorafleet_schemas.messages import JobState
from lorafleet_services.cli import app
from tests.permissions.conftest import IdentityFleet, identity_settings
from tests.permissions.flow import identity_system

COMPOSE = Path(__file__).resolve().parents[2] / "compose"
NATS_CONF = COMPOSE / "nats-cluster" / "nats.conf"


@pytest.fixture
async def compose_fleet(tmp_path: Path) -> AsyncIterator[tuple[IdentityFleet, NatsCluster]]:
    """`lorafleet auth` as compose's header says, then the cluster from compose's
    very config, with the authorization block mounted beside it."""
    identities = tmp_path / "identities"
    made = CliRunner().invoke(app, ["auth", "--dir", str(identities), "--node", "node-1"])
    assert made.exit_code == 0, made.output
    etc = tmp_path / "etc-nats"
    etc.mkdir()
    shutil.copy(NATS_CONF, etc / "nats.conf")
    shutil.copy(identities / "authorization.conf", etc / "authorization.conf")
    cluster = NatsCluster(tmp_path / "cluster", config_file=etc / "nats.conf")
    await cluster.start()
    base = identity_settings(tmp_path, request_timeout_s=5.0, replicas=3)
    member = cluster.servers[cluster.names[0]]
    try:
        fleet = IdentityFleet(member, IdentityStore(identities), base, urls=cluster.url)
        yield fleet, cluster
    finally:
        await cluster.stop()


async def test_composes_nats_config_runs_a_job_with_every_process_on_its_own_identity(
    compose_fleet: tuple[IdentityFleet, NatsCluster], tmp_path: Path, sqlite_url: str
) -> None:
    fleet, cluster = compose_fleet
    async with identity_system(fleet, tmp_path, sqlite_url) as system:
        varz = await cluster.monitor("nats-1", "/varz")
        assert varz["jetstream"]["config"]["sync_always"] is True
        assert varz["cluster"]["name"] == "lorafleet"
        # Users are what authorization.conf holds: nkeys only, no password.
        assert varz["auth_required"] is True
        job, out = await system.run_job(tmp_path)
        assert job.state is JobState.DONE, job
        assert out.stat().st_size > 0
        # (The client identity may not read stream configs: the monitor can.)
        jsz = await cluster.monitor("nats-1", "/jsz?streams=true&config=true")
        streams = {
            d["name"]: d["config"]["num_replicas"]
            for account in jsz["account_details"]
            for d in account.get("stream_detail", [])
        }
        assert streams[fleet.base.names.status_stream] == 3, streams
        assert system.refusals() == {}, system.refusals()
