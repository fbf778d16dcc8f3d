"""What the nemesis found that needs the three-server cluster, each pinned
by a test of its own (beside its seed in test_nemesis_run.py)."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from lorafleet.natscluster import NatsCluster
from lorafleet.natsserver import NatsServer
from lorafleet_schemas.messages import JobState
from tests.cluster.helpers import (
    END_TIMEOUT_S,
    FINISHED,
    RECORDER_ACK_WAIT_S,
    TRAINING,
    no_false_loss,
    story,
)
from tests.system.conftest import Stack

#: Seconds the agent's server stays frozen: past the node timeout (3 s).
FROZEN_S = 5.0


@pytest.fixture
async def nats_cluster(tmp_path: Path) -> AsyncIterator[NatsCluster]:
    cluster = NatsCluster(tmp_path / "cluster")
    await cluster.start()
    try:
        yield cluster
    finally:
        for server in cluster.servers.values():  # a failed test may leave one stopped
            if server.proc is not None and server.proc.returncode is None:
                os.kill(server.proc.pid, signal.SIGCONT)
        await cluster.stop()


@pytest.fixture
def nats_server(nats_cluster: NatsCluster) -> NatsServer:
    return nats_cluster.servers[nats_cluster.names[0]]


@pytest.fixture
def stack_settings(nats_cluster: NatsCluster) -> dict[str, Any]:
    """The control plane (and the test's client) on the first two members."""
    return {
        "nats_url": ",".join(nats_cluster.urls(nats_cluster.names[:2])),
        "replicas": 3,
        "recorder_ack_wait_s": RECORDER_ACK_WAIT_S,
    }


async def test_the_agents_server_frozen_is_no_node_loss(
    stack: Stack, nats_cluster: NatsCluster
) -> None:
    """Seed 3: a member SIGSTOPped for 3.4 s lost the node whose agent was on
    it: the frozen server answered no PING, so the agent took it for its own
    link cut and waited, and its beat expired. It now moves to another member
    (a cut link lets it reach none, and it fences as before)."""
    await stack.add_model()
    victim = nats_cluster.servers[nats_cluster.names[2]]
    # Given one URL, as an operator might: the server tells it the others.
    agent = await stack.agent("node-1", env=TRAINING, nats_url=victim.url)
    job = await stack.submit("node-1")
    await stack.wait_state(job.id, JobState.RUNNING)
    assert victim.proc is not None
    os.kill(victim.proc.pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(FROZEN_S)
    finally:
        os.kill(victim.proc.pid, signal.SIGCONT)
    done = await stack.wait_state(job.id, *FINISHED, JobState.FAILED, timeout_s=END_TIMEOUT_S)
    assert done.state in FINISHED, f"{done.message}\n{story(*stack.schedulers, agent)}"
    no_false_loss(stack, agent)
    assert agent.events("nats.moved"), "the agent never left the frozen server"
