"""What the cluster benchmarks share: the system as real processes on a URL.

`system(url, replicas)` runs the recorder (a throwaway PostgreSQL database
on 127.0.0.1:5432), one scheduler and the artifact-store against a NATS URL
(one server, or every member of a cluster), as the system tests do
(tests/system/conftest.py's `Stack`), with heartbeat 0.5 s and node
timeout 3 s. Agents are started by the bench.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.*
from tests.eventually import eventually
from tests.partition.helpers import agent_in
from tests.partition.netns import NetnsLink, available
from tests.pg import throwaway_database
from tests.procs import ServiceProcess
from tests.system.conftest import Stack, kill_pid, pid_alive, trainer_pids

# What the cluster benches take from the tests (imported here, after the path).
__all__ = [
    "NetnsLink",
    "Stack",
    "agent_in",
    "available",
    "eventually",
    "kill_pid",
    "pid_alive",
    "summary",
    "system",
    "trainer_pids",
]

from lorafleet import _bus as bus
from lorafleet.natsserver import NatsServer
from lorafleet.settings import Settings


@asynccontextmanager
async def system(
    url: str, server: NatsServer, tmp: Path, replicas: int = 1
) -> AsyncIterator[Stack]:
    with throwaway_database("lorafleet_bench") as db_url:
        settings = Settings(
            nats_url=url,
            data_dir=str(tmp / "data"),
            database_url=db_url,
            heartbeat_s=0.5,
            node_timeout_s=3,
            request_timeout_s=3.0,
            replicas=replicas,
        )
        nc = await bus.connect(settings, "bench")
        js = nc.jetstream()
        await bus.ensure_layout(js, bus.layout_for(settings))
        recorder = ServiceProcess("lorafleet_services.recorder", settings)
        stack = Stack(settings, server, nc, js, tmp, recorder, procs=[recorder])
        try:
            await recorder.start()
            stack.artifact_store = ServiceProcess("lorafleet_services.artifact_store", settings)
            stack.procs.append(stack.artifact_store)
            await stack.artifact_store.start()
            await stack.scheduler()
            await stack.add_model()
            yield stack
        finally:
            for proc in [*stack.agents.values(), *stack.procs]:
                with contextlib.suppress(Exception):
                    await proc.stop(timeout_s=5)
            await bus.drain_quietly(nc)


def summary(name: str, values: list[float]) -> str:
    return (
        f"{name}: median {statistics.median(values):.3f} s, worst {max(values):.3f} s "
        f"(n={len(values)})"
    )
