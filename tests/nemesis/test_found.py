"""What the nemesis found, each pinned by a test of its own (beside its seed
in test_nemesis_run.py): the fault alone, the smallest stack that shows it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path

from lorafleet import _bus as bus
from lorafleet.natscluster import NatsCluster
from lorafleet_schemas.messages import JobState
from tests.procs import ServiceProcess
from tests.system.conftest import Stack, system_settings

#: Seconds the scheduler stays paused: past the node timeout (3 s).
PAUSED_S = 4.0
#: Seconds after it resumes in which a false loss would show.
AFTER_S = 3.0
#: Seconds the member stays cut off: longer than a JetStream request's
#: timeout, so a start that does not try again has failed by then.
CUT_OFF_S = 8.0


async def test_a_service_started_on_a_cut_off_member_starts_once_it_is_back(
    tmp_path: Path, pg_url: str
) -> None:
    """Seed 3: a scheduler restarted while the member it connected to was cut
    from the other two (a minority partition) exited at start: its layout
    request timed out. It now tries again, and starts once the member is back."""
    cluster = NatsCluster(tmp_path / "cluster")
    await cluster.start()
    proc: ServiceProcess | None = None
    try:
        settings = system_settings(cluster.url, pg_url, tmp_path).with_(replicas=3)
        nc = await bus.connect(settings, "test")
        await bus.ensure_layout(nc.jetstream(), bus.layout_for(settings))
        await bus.drain_quietly(nc)
        await cluster.isolate("nats-3")
        only_there = settings.with_(nats_url=cluster.servers["nats-3"].url)
        proc = ServiceProcess("lorafleet_services.scheduler", only_there)
        starting = asyncio.create_task(proc.start())
        await asyncio.sleep(CUT_OFF_S)
        assert not starting.done(), "the scheduler gave up while the member was cut off"
        await cluster.rejoin("nats-3")
        await starting
        assert proc.running
    finally:
        if proc is not None:
            with contextlib.suppress(Exception):
                await proc.stop()
        await cluster.stop()


async def test_a_scheduler_paused_past_the_node_timeout_loses_no_node(stack: Stack) -> None:
    """Seed 3: a scheduler SIGSTOPped for 3.2 s judged two live nodes lost the
    moment it resumed: its sweep ran before its watch handed it the beats
    that had come meanwhile. The silence was its own, and is forgiven."""
    await stack.add_model()
    await stack.agent("node-1", {"LORAFLEET_STANDIN_STEP_S": "0.1"})
    job = await stack.submit("node-1", params={"max_steps": 120})
    await stack.wait_state(job.id, JobState.RUNNING)
    [scheduler] = stack.schedulers
    os.kill(scheduler.pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(PAUSED_S)
    finally:
        os.kill(scheduler.pid, signal.SIGCONT)
    await asyncio.sleep(AFTER_S)
    assert scheduler.events("node.lost") == [], scheduler.events("node.lost")
    assert (await stack.get(job.id)).state is JobState.RUNNING
