"""Submit to start request received, with many idle nodes heartbeating.

    .venv/bin/python bench/scheduler_dispatch.py [--nodes 500] [--jobs 200]

A real nats-server, PostgreSQL, recorder and scheduler; `--nodes` simulated
idle nodes (bench/scheduler_common.py) heartbeat at the default 1 Hz from
this process. Each trial submits one job (half named for a node, half left
to placement) and times from just before the submit request until the
simulated node has received the scheduler's start request; the job is then
cancelled, so the node is idle again. Trials run one at a time.

The baseline is the same run with a single node heartbeating: the ratio
shows what the fleet's heartbeat traffic costs dispatch. Target: p99 at
most 100 ms with 500 nodes.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

from scheduler_common import bench_stack, percentile, recording_fleet, summary

#: Trials run first and not counted (connections, caches, the database warm up).
WARMUP = 10


async def measure(nodes: int, jobs: int) -> tuple[list[float], list[float]]:
    """(submit -> start received, submit round trip alone), in seconds."""
    async with bench_stack() as stack:
        await stack.add_model()
        latencies: list[float] = []
        submits: list[float] = []
        async with recording_fleet(stack, nodes) as (fleet, times):
            await asyncio.sleep(1.0)
            names = list(fleet.nodes)
            rng = random.Random(7)
            for i in range(WARMUP + jobs):
                node = rng.choice(names) if i % 2 == 0 else None
                t0 = time.perf_counter()
                job_id = await stack.submit(node)
                t_submitted = time.perf_counter()
                started = await times.of(job_id)
                if i >= WARMUP:
                    latencies.append(started - t0)
                    submits.append(t_submitted - t0)
                await stack.call(stack.settings.names.jobs_cancel, {"id": job_id})
                # Let the cancel reach the node and its next beat say it is idle.
                await asyncio.sleep(0.02)
        return latencies, submits


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=500)
    ap.add_argument("--jobs", type=int, default=200)
    args = ap.parse_args()
    base, base_submit = await measure(1, args.jobs)
    fleet, fleet_submit = await measure(args.nodes, args.jobs)
    print(f"baseline, 1 node:        {summary(base)}")
    print(f"  of which the submit request: {summary(base_submit)}")
    print(f"{args.nodes} nodes heartbeating: {summary(fleet)}")
    print(f"  of which the submit request: {summary(fleet_submit)}")
    p99_base, p99 = percentile(base, 99), percentile(fleet, 99)
    print(f"p99 ratio {p99 / p99_base:.2f}x the 1-node baseline; target p99 <= 100 ms: "
          f"{'met' if p99 <= 0.100 else 'NOT met'}")  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())
