"""Cluster tests: the system's real processes on a real three-server NATS
cluster (lorafleet.nats.cluster), with every stream, KV and object store at
R3 and every process given all three URLs.

`nats_cluster` starts the cluster; the system tests' `stack` fixture runs
on it (this conftest points `nats_server` at the first member, so no other
server starts, and `stack_settings` at every member with replicas 3).
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from lorafleet.nats.cluster import NatsCluster
from lorafleet.nats.server import NatsServer
from tests.cluster.helpers import RECORDER_ACK_WAIT_S
from tests.system.conftest import stack  # noqa: F401 (the fixture, run on the cluster)


@pytest.fixture
async def nats_cluster(tmp_path: Path) -> AsyncIterator[NatsCluster]:
    cluster = NatsCluster(tmp_path / "cluster")
    await cluster.start()
    try:
        yield cluster
    finally:
        for server in cluster.servers.values():  # a failed test may leave one stopped
            if server.proc is not None and server.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(server.proc.pid, signal.SIGCONT)
        await cluster.stop()


@pytest.fixture
def nats_server(nats_cluster: NatsCluster) -> NatsServer:
    return nats_cluster.servers[nats_cluster.names[0]]


@pytest.fixture
def stack_settings(nats_cluster: NatsCluster) -> dict[str, Any]:
    return {
        "nats_url": nats_cluster.url,
        "replicas": 3,
        "recorder_ack_wait_s": RECORDER_ACK_WAIT_S,
    }
