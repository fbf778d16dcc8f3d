"""Node loss to training steps flowing again on another node, against node
loss to a failed job (same script).

    .venv/bin/python bench/resume_after_node_loss.py [--trials 10]

A real nats-server, PostgreSQL, recorder, scheduler, artifact-store and two
agents (node timeout 3 s, heartbeat 0.5 s, as the system tests run). Each
trial submits a placed stand-in job (0.05 s a step, a checkpoint every 10
steps), waits until a checkpoint is stored, then SIGKILLs the agent that
runs it and its trainer — the machine went away — and times, from that
moment:
- resume (max_attempts 2): until the recorder holds a step of attempt 2
  past the checkpoint it resumed from: the work is flowing again on the
  other node;
- baseline (max_attempts 1): until the recorder holds the job failed.
The killed agent is started again between trials. Target: resumed within
node timeout + 10 s.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from cluster_common import Stack, kill_pid, summary, system, trainer_pids
from lorafleet.nats.server import NatsServer
from lorafleet_schemas.messages import JobRecord, JobState

POLL_S = 0.02
ENV = {"LORAFLEET_STANDIN_STEP_S": "0.05"}
PARAMS = {"max_steps": 100_000, "checkpoint_every_steps": 10}
TRIAL_TIMEOUT_S = 60.0


async def until(stack: Stack, job_id: str, done: object, what: str) -> JobRecord:
    deadline = time.monotonic() + TRIAL_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            job = await stack.get(job_id)
        except Exception:  # a service between requests: try again
            job = None
        if job is not None and done(job):  # type: ignore[operator]
            return job
        await asyncio.sleep(POLL_S)
    raise RuntimeError(f"job {job_id}: {what} did not happen within {TRIAL_TIMEOUT_S} s")


async def trial(stack: Stack, attempts: int) -> float:
    job = await stack.submit(None, params=PARAMS, max_attempts=attempts)
    seen = await until(
        stack, job.id, lambda j: j.checkpoint is not None and j.state is JobState.RUNNING,
        "a stored checkpoint",
    )  # fmt: skip
    node = seen.node
    assert node is not None
    pids = trainer_pids(stack.agents[node], job.id)
    stack.agents[node].kill()
    t0 = time.monotonic()
    for pid in pids:
        kill_pid(pid)
    if attempts == 1:
        await until(stack, job.id, lambda j: j.state is JobState.FAILED, "failed")
    else:
        at = seen.checkpoint.step if seen.checkpoint else 0
        await until(stack, job.id, lambda j: j.attempt == 2 and j.step > at, "steps of attempt 2")
    took = time.monotonic() - t0
    await stack.cancel(job.id, reason="bench trial over")
    await stack.agent(node, env=ENV)  # the machine is back for the next trial
    return took


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=10)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = NatsServer(Path(tmp) / "nats")
        await server.start()
        try:
            async with system(server.url, server, Path(tmp)) as stack:
                for node in ("node-1", "node-2"):
                    await stack.agent(node, env=ENV)
                failed: list[float] = []
                resumed: list[float] = []
                for n in range(args.trials):
                    failed.append(await trial(stack, 1))
                    resumed.append(await trial(stack, 2))
                    print(f"trial {n}: failed after {failed[-1]:.3f} s, "
                          f"resumed after {resumed[-1]:.3f} s")  # fmt: skip
        finally:
            await server.stop()
    timeout_s = 3
    print(summary("node loss -> job failed (max_attempts 1)", failed))
    print(summary("node loss -> steps flowing on another node (max_attempts 2)", resumed))
    target = timeout_s + 10
    ratio = statistics.median(resumed) / statistics.median(failed)
    print(
        f"resume / fail (median): {ratio:.2f}x; "
        f"target worst <= node timeout + 10 s = {target} s: "
        f"{'met' if max(resumed) <= target else 'NOT met'}"
    )


if __name__ == "__main__":
    asyncio.run(main())
