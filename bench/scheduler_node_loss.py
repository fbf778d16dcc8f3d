"""Node loss to job failed, at default settings (heartbeat 1 s, node timeout 3 s).

    .venv/bin/python bench/scheduler_node_loss.py [--trials 20]

A real nats-server, PostgreSQL, recorder and scheduler. Each trial starts a
simulated node (bench/scheduler_common.py: a real heartbeat publisher with
a per-message TTL that answers its start requests), submits a job for it,
waits until the node has it, then stops the node's heartbeats — as if the
machine lost power — and times until the recorder publishes the job's
`failed` event. Two figures per trial:

- from the loss (the moment the beats stop): what a user waits;
- from the node's last beat: the node timeout is the floor here, so the
  baseline is `node_timeout_s` itself and the ratio is the overhead of the
  expiry marker, the scheduler and the recorder on top of it.

Target: 3 s worst from the loss.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time

import msgspec
from nats.aio.msg import Msg

from lorafleet_schemas.messages import JobEvent, JobState, StartRequest
from scheduler_common import Fleet, bench_stack


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=20)
    args = ap.parse_args()
    from_loss: list[float] = []
    from_beat: list[float] = []
    async with bench_stack() as stack:
        await stack.add_model()
        failed_at: dict[str, float] = {}
        messages: dict[str, str] = {}
        failed = asyncio.Event()

        async def on_event(msg: Msg) -> None:
            event = msgspec.json.decode(msg.data, type=JobEvent)
            if event.job.state is JobState.FAILED:
                failed_at.setdefault(event.job.id, time.monotonic())
                messages[event.job.id] = event.job.message
                failed.set()

        await stack.nc.subscribe(stack.settings.names.all_job_events, cb=on_event)
        for trial in range(args.trials):
            got: asyncio.Event = asyncio.Event()

            def on_start(node: str, req: StartRequest, at: float, got: asyncio.Event = got) -> None:
                got.set()

            fleet = Fleet(stack.nc, stack.settings, 1, prefix=f"loss{trial}", on_start=on_start)
            await fleet.start()
            (name,) = fleet.nodes
            job_id = await stack.submit(name)
            await asyncio.wait_for(got.wait(), 20)
            # A random phase within the beat period, as a real failure would have.
            await asyncio.sleep(1.0 + (trial % 10) / 10)
            node = fleet.nodes[name]
            await fleet.stop()
            node.beating = False
            lost = time.monotonic()
            last_beat = node.last_beat
            deadline = lost + 15
            while job_id not in failed_at and time.monotonic() < deadline:
                failed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(failed.wait(), 0.5)
            if job_id not in failed_at:
                raise RuntimeError(f"trial {trial}: job {job_id} was not failed within 15 s")
            from_loss.append(failed_at[job_id] - lost)
            from_beat.append(failed_at[job_id] - last_beat)
            print(f"trial {trial:2d}: {from_loss[-1]:.3f} s after the loss, "
                  f"{from_beat[-1]:.3f} s after the last beat")  # fmt: skip
        print(f"message: {messages[job_id]}")
    timeout_s = stack.settings.node_timeout_s
    print(
        f"from the loss:      median {statistics.median(from_loss):.3f} s, "
        f"worst {max(from_loss):.3f} s (target: worst <= 3 s: "
        f"{'met' if max(from_loss) <= 3.0 else 'NOT met'})"
    )
    print(
        f"from the last beat: median {statistics.median(from_beat):.3f} s, "
        f"worst {max(from_beat):.3f} s = {max(from_beat) / timeout_s:.3f}x the "
        f"{timeout_s} s node timeout (the floor)"
    )


if __name__ == "__main__":
    asyncio.run(main())
