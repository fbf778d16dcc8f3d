"""Job completion time on a three-server cluster (R3) against one server (same script).

    .venv/bin/python bench/cluster_completion.py [--trials 5]

The same system (bench/cluster_common.py: PostgreSQL, recorder, scheduler,
artifact-store, one agent with the stand-in trainer, 40 steps of 0.02 s)
first on one nats-server (the baseline), then on a three-server cluster
(lorafleet.nats.cluster, `sync_interval: always`, every stream, KV and
object store at R3, every process given all three URLs). Each trial
submits a job and times submit -> `done` (the artifact stored and
verified). The ratio is what replication (and fsync on every write) costs
a job end to end.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from cluster_common import Stack, summary, system
from lorafleet.nats.cluster import NatsCluster
from lorafleet.nats.server import NatsServer
from lorafleet_schemas.messages import JobState

STANDIN = {"LORAFLEET_STANDIN_STEPS": "40", "LORAFLEET_STANDIN_STEP_S": "0.02"}


async def run_jobs(stack: Stack, trials: int) -> list[float]:
    await stack.agent("node-1", env=STANDIN)
    times: list[float] = []
    for _ in range(trials + 1):  # the first one warms up (imports, first connections)
        t0 = time.monotonic()
        job = await stack.submit("node-1")
        done = await stack.wait_state(job.id, JobState.DONE, JobState.FAILED, timeout_s=120)
        if done.state is not JobState.DONE:
            raise RuntimeError(done.message)
        times.append(time.monotonic() - t0)
    return times[1:]


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        server = await NatsServer(root / "single").start()
        try:
            async with system(server.url, server, root / "s1") as stack:
                single = await run_jobs(stack, args.trials)
        finally:
            await server.stop()
        cluster = await NatsCluster(root / "cluster").start()
        try:
            first = cluster.servers[cluster.names[0]]
            async with system(cluster.url, first, root / "s3", replicas=3) as stack:
                clustered = await run_jobs(stack, args.trials)
        finally:
            await cluster.stop()
    print(summary("one server        submit -> done", single))
    print(summary("three servers, R3 submit -> done", clustered))
    ratio = statistics.median(clustered) / statistics.median(single)
    print(f"cluster / one server (medians): {ratio:.2f}x")


if __name__ == "__main__":
    asyncio.run(main())
