"""What the cluster benchmarks share: the system as real processes on a URL.

`system(url, replicas)` runs the recorder (a throwaway PostgreSQL database
on 127.0.0.1:5432), one scheduler and the artifact-store against a NATS URL
(one server, or every member of a cluster), as the system tests do
(tests/system/conftest.py's `Stack`), with heartbeat 0.5 s and node
timeout 3 s. Agents are started by the bench.
"""

from __future__ import annotations

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
from tests.system.conftest import (
    Stack,
    kill_pid,
    pid_alive,
    running_stack,
    system_settings,
    trainer_pids,
)

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

from lorafleet.nats.server import NatsServer


@asynccontextmanager
async def system(
    url: str, server: NatsServer, tmp: Path, replicas: int = 1
) -> AsyncIterator[Stack]:
    with throwaway_database("lorafleet_bench") as db_url:
        settings = system_settings(url, db_url, tmp).with_(replicas=replicas)
        async with running_stack(settings, server, tmp, "bench") as stack:
            await stack.add_model()
            yield stack


def summary(name: str, values: list[float]) -> str:
    return (
        f"{name}: median {statistics.median(values):.3f} s, worst {max(values):.3f} s "
        f"(n={len(values)})"
    )
