"""The scheduler's CPU share with 1,000 simulated nodes heartbeating at 1 Hz.

    .venv/bin/python bench/scheduler_cpu.py [--nodes 1000] [--seconds 20]

A real nats-server, PostgreSQL, recorder and scheduler; `--nodes`
simulated idle nodes (bench/scheduler_common.py) beat once a second from
this process. Once the scheduler lists them all, its process CPU time
(user + system, from /proc via psutil) is read over `--seconds` of wall
time. The baseline is the same scheduler with no nodes at all (its 1 s
sweep and leader renewals only). Target: under 25% of one core.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import psutil

from scheduler_common import Fleet, bench_stack, wait_nodes_listed


async def share(nodes: int, seconds: float) -> tuple[float, float]:
    """(scheduler CPU share of one core, this process's share) over `seconds`."""
    async with bench_stack() as stack:
        fleet = Fleet(stack.nc, stack.settings, nodes)
        if nodes:
            await fleet.start()
            await wait_nodes_listed(stack, nodes, timeout_s=60)
        await asyncio.sleep(2.0)
        proc = psutil.Process(stack.scheduler.pid)
        me = psutil.Process()
        c0, m0, t0 = proc.cpu_times(), me.cpu_times(), time.monotonic()
        await asyncio.sleep(seconds)
        c1, m1, t1 = proc.cpu_times(), me.cpu_times(), time.monotonic()
        listed = await stack.call(stack.settings.names.nodes_list, {})
        alive = sum(1 for n in listed["nodes"] if n["alive"])
        await fleet.stop()
        if alive < nodes:
            print(f"warning: only {alive} of {nodes} nodes were alive at the end")
        wall = t1 - t0
        used = (c1.user - c0.user) + (c1.system - c0.system)
        mine = (m1.user - m0.user) + (m1.system - m0.system)
        return used / wall, mine / wall


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=20.0)
    args = ap.parse_args()
    base, _ = await share(0, args.seconds)
    load, heartbeaters = await share(args.nodes, args.seconds)
    print(f"baseline, no nodes:  scheduler {base * 100:.1f}% of one core")
    print(f"{args.nodes} nodes at 1 Hz: scheduler {load * 100:.1f}% of one core "
          f"({load / max(base, 1e-3):.1f}x the baseline; the simulated nodes took "
          f"{heartbeaters * 100:.1f}%)")  # fmt: skip
    print(f"target < 25% of one core: {'met' if load < 0.25 else 'NOT met'}")


if __name__ == "__main__":
    asyncio.run(main())
