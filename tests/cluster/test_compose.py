"""compose/: the NATS config compose mounts boots, here, as a real
three-server cluster that runs a job; the compose files parse and name only
commands, settings and files the project defines."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from lorafleet.natscluster import NatsCluster
from lorafleet_schemas.messages import JobState
from tests.cluster.helpers import END_TIMEOUT_S, FINISHED
from tests.system.conftest import Stack

COMPOSE = Path(__file__).resolve().parents[2] / "compose"
NATS_CONF = COMPOSE / "nats-cluster" / "nats.conf"


@pytest.fixture
async def nats_cluster(tmp_path: Path) -> AsyncIterator[NatsCluster]:
    """The cluster, from compose's very file (this module's own fixture)."""
    cluster = NatsCluster(tmp_path / "cluster", config_file=NATS_CONF)
    await cluster.start()
    try:
        yield cluster
    finally:
        await cluster.stop()


async def test_composes_nats_config_boots_a_cluster_that_runs_a_job(
    stack: Stack, nats_cluster: NatsCluster
) -> None:
    varz = await nats_cluster.monitor("nats-1", "/varz")
    assert varz["jetstream"]["config"]["sync_always"] is True
    assert varz["cluster"]["name"] == "lorafleet"
    streams = await nats_cluster.monitor(nats_cluster.names[0], "/jsz?streams=true")
    assert streams["meta_cluster"]["cluster_size"] == 3
    await stack.add_model()
    await stack.agent("node-1")
    job = await stack.submit("node-1")
    done = await stack.wait_state(job.id, *FINISHED, JobState.FAILED, timeout_s=END_TIMEOUT_S)
    assert done.state in FINISHED, done.message
    info = await stack.js.stream_info(stack.settings.names.status_stream)
    assert info.config.num_replicas == 3
