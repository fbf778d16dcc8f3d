"""Node loss by a cut network link, against SIGKILL of the agent (same script).

    .venv/bin/python bench/cluster_partition.py [--trials 10]

Needs root (network namespaces). A real nats-server listening on the bench's
end of a veth pair, PostgreSQL, recorder, scheduler, artifact-store. Each
trial starts a fresh agent (node `node-<mode>-<trial>`) inside the
namespace at the other end (tests/partition/netns.py), submits a long
stand-in job to it, waits until it runs, then either
- cuts the link (the node is alive, its network is not), or
- SIGKILLs the agent (the baseline: the easy case, the process is gone),
and times, from that moment, (a) until the recorder holds the job failed
and (b) until the trainer's processes are gone. With a cut link (b) is the
agent's own fencing; with SIGKILL it is the trainer's parent-death signal.
Target: both within node timeout (3 s) + 1 s.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from cluster_common import (
    NetnsLink,
    Stack,
    agent_in,
    available,
    eventually,
    kill_pid,
    pid_alive,
    summary,
    system,
    trainer_pids,
)
from lorafleet.nats.server import NatsServer
from lorafleet_schemas.messages import JobState

POLL_S = 0.02


async def trial(stack: Stack, link: NetnsLink, n: int, mode: str) -> tuple[float, float]:
    node = f"node-{mode}-{n}"
    agent = await agent_in(stack, link, node, {"LORAFLEET_STANDIN_STEP_S": "0.1"})
    job = await stack.submit(node, params={"max_steps": 600})
    await stack.wait_state(job.id, JobState.RUNNING)
    pids = await eventually(lambda: trainer_pids(agent), "the trainer's pids")
    t0 = time.monotonic()
    if mode == "cut":
        link.cut()
    else:
        agent.kill()
    failed_s = stopped_s = 0.0
    try:
        while not (failed_s and stopped_s):
            now = time.monotonic() - t0
            if not stopped_s and not any(pid_alive(p) for p in pids):
                stopped_s = now
            if not failed_s and (await stack.get(job.id)).state is JobState.FAILED:
                failed_s = time.monotonic() - t0
            if now > 30:
                raise TimeoutError(f"trial {mode} {n}: failed {failed_s}, stopped {stopped_s}")
            await asyncio.sleep(POLL_S)
    finally:
        link.restore()
        agent.kill()
        for pid in pids:
            kill_pid(pid)
    return failed_s, stopped_s


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=10)
    args = ap.parse_args()
    why = available()
    if why is not None:
        raise SystemExit(f"cannot run: {why}")
    results: dict[str, list[tuple[float, float]]] = {"cut": [], "sigkill": []}
    with tempfile.TemporaryDirectory() as tmp:
        # One namespace and link for the run: the server listens on its
        # host end; each trial's agent is a fresh process inside it.
        hub = NetnsLink().create()
        try:
            server = NatsServer(Path(tmp) / "nats", host=hub.host_ip)
            await server.start()
            try:
                async with system(server.url, server, Path(tmp)) as stack:
                    for n in range(args.trials):
                        for mode in results:
                            results[mode].append(await trial(stack, hub, n, mode))
            finally:
                await server.stop()
        finally:
            hub.delete()
    for mode, rows in results.items():
        print(summary(f"{mode:8s} job failed   ", [r[0] for r in rows]))
        print(summary(f"{mode:8s} trainer gone ", [r[1] for r in rows]))
    cut, kill = results["cut"], results["sigkill"]
    ratio = sorted(r[0] for r in cut)[len(cut) // 2] / sorted(r[0] for r in kill)[len(kill) // 2]
    print(f"job failed, cut link / SIGKILL (medians): {ratio:.2f}x")


if __name__ == "__main__":
    asyncio.run(main())
