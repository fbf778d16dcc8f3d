"""What the cluster tests share: finding leaders and connections, and the
checks every server-loss test makes."""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest

from lorafleet import Client
from lorafleet.names import kv_stream
from lorafleet.nats.cluster import NatsCluster, stream_leader
from lorafleet_schemas.messages import JobState, StatusReport
from tests.eventually import NeverHappenedError, eventually
from tests.procs import ServiceProcess
from tests.system.conftest import Stack, has_artifact_store

FINISHED = (JobState.DONE,) if has_artifact_store() else (JobState.DONE, JobState.UPLOADING)
#: The stand-in trains 100 steps of 0.1 s: long enough to outlive an
#: election (about 5 s) plus the node timeout, so a false loss would show.
TRAINING = {"LORAFLEET_STANDIN_STEPS": "100", "LORAFLEET_STANDIN_STEP_S": "0.1"}
#: Seconds a job may take to end on the cluster (elections included).
END_TIMEOUT_S = 60.0


@pytest.fixture(name="stack_settings")
def control_plane_on_the_first_two(nats_cluster: NatsCluster) -> dict[str, Any]:
    """The `stack_settings` fixture of a test that cuts the third member off:
    the control plane (and the test's client) on the first two. Import it."""
    return {
        "nats_url": ",".join(nats_cluster.urls(nats_cluster.names[:2])),
        "replicas": 3,
        "recorder_ack_wait_s": RECORDER_ACK_WAIT_S,
    }


@contextlib.asynccontextmanager
async def cut_off(cluster: NatsCluster, member: str) -> AsyncIterator[None]:
    """`member` cut off from the other two (its clients still on it) while the
    block runs; back in the cluster after it, however it ended."""
    await cluster.isolate(member)
    try:
        yield
    finally:
        await cluster.rejoin(member)


async def leader_of(stack: Stack, stream: str) -> str:
    """The member leading `stream` (asked until it has one)."""
    return await eventually(
        lambda: stream_leader(stack.js, stream), f"{stream} to have a leader", retry_on=(Exception,)
    )


async def connected_member(cluster: NatsCluster, client_name: str) -> str:
    """The member a client (by its connection name) is connected to, from /connz."""

    async def find() -> str | None:
        for member in cluster.running():
            connz = await cluster.monitor(member, "/connz?limit=1024")
            if any(c.get("name") == client_name for c in connz.get("connections") or []):
                return member
        return None

    return await eventually(find, f"{client_name} to be connected", retry_on=(OSError,))


async def lead_elsewhere(stack: Stack, leader: str, avoid: str) -> None:
    """Move the status stream, the heartbeat bucket and the recorder's consumer
    to `leader` wherever `avoid` leads one (a JetStream leader stepdown with a
    preferred member, asked until it holds)."""
    names = stack.settings.names
    streams = [names.status_stream, kv_stream(names.nodes_bucket)]
    body = json.dumps({"placement": {"preferred": leader}}).encode()

    async def consumer_leader() -> str:
        info = await stack.js.consumer_info(names.status_stream, names.recorder_consumer)
        return info.cluster.leader if info.cluster is not None and info.cluster.leader else ""

    async def placed() -> bool:
        led = [await stream_leader(stack.js, s) for s in streams] + [await consumer_leader()]
        if avoid not in led:
            return True
        for stream, member in zip(streams, led, strict=False):
            if member == avoid:
                await stack.nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}", body, 5.0)
        if led[-1] == avoid:
            subject = f"$JS.API.CONSUMER.LEADER.STEPDOWN.{names.status_stream}"
            await stack.nc.request(f"{subject}.{names.recorder_consumer}", body, 5.0)
        return False

    await eventually(placed, f"no leader on {avoid}", retry_on=(Exception,), interval_s=0.5)


def no_false_loss(stack: Stack, agent: ServiceProcess) -> None:
    """Nobody judged the node lost, and its agent never fenced itself."""
    for scheduler in stack.schedulers:
        assert scheduler.events("node.lost") == [], scheduler.events("node.lost")
        assert scheduler.events("job.lost") == [], scheduler.events("job.lost")
    assert agent.events("agent.fenced") == [], agent.events("agent.fenced")


#: The recorder's ack wait on the cluster. A report the server had sent to
#: the recorder as their connection went (a restart) is never received; the
#: server sends it again after this long, possibly once the job has ended.
RECORDER_ACK_WAIT_S = 5.0


async def assert_each_step_once(stack: Stack, job_id: str, steps: int) -> None:
    """Every step in the curve, once: each missing one must come within the
    recorder's ack wait (and a margin), and none may come twice."""
    wanted = list(range(1, steps + 1))

    async def recorded() -> list[int]:
        return [p.step for p in (await stack.curve(job_id)).points]

    try:
        await eventually(
            recorded, "every step in the curve", until=lambda got: sorted(got) == wanted,
            timeout_s=RECORDER_ACK_WAIT_S + 5.0, interval_s=0.5,
        )  # fmt: skip
    except NeverHappenedError:
        got = await recorded()
        raise AssertionError(await missing_steps_story(stack, job_id, got, steps)) from None


async def missing_steps_story(stack: Stack, job_id: str, recorded: list[int], steps: int) -> str:
    """Where the missing steps went: stored in the status stream (the recorder
    lost or refused them) or never stored (the publish side lost them)."""
    missing = sorted(set(range(1, steps + 1)) - set(recorded))
    dupes = sorted({s for s in recorded if recorded.count(s) > 1})
    stored: dict[int, int] = {}  # step -> stream sequence
    job = await stack.get(job_id)
    sub = await stack.js.subscribe(
        stack.settings.names.status(job.node or "*", job_id), ordered_consumer=True
    )
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=1.0)
            except TimeoutError:
                break
            report = msgspec.json.decode(msg.data, type=StatusReport)
            if report.step is not None and report.loss is not None:
                stored[report.step] = msg.metadata.sequence.stream
    finally:
        await sub.unsubscribe()
    said = [
        f"{proc.module}: {line}"
        for proc in dict.fromkeys([*stack.procs, *stack.agents.values()])
        for line in proc.lines
        if line.get("event") in ("status.refused", "status.retry", "status.dropped")
    ]
    return (
        f"steps missing from the curve: {missing}; recorded twice: {dupes}; of the missing, "
        f"stored in the status stream: {[(s, stored[s]) for s in missing if s in stored]}, "
        f"never stored: {[s for s in missing if s not in stored]}\n" + "\n".join(said[-40:])
    )


def story(*procs: ServiceProcess) -> str:
    """What the processes said about nodes, watches, fencing and NATS (for failures)."""
    keep = ("node.", "watch.", "agent.", "nats.", "heartbeat.", "job.lost", "leader.")
    lines = []
    for proc in procs:
        for line in proc.lines:
            if str(line.get("event", "")).startswith(keep):
                lines.append(f"{proc.module}: {line}")
    return "\n".join(lines[-60:])


async def assert_artifacts_intact(stack: Stack, job_id: str) -> None:
    """Every artifact of the job downloads and matches its recorded sha256."""
    client = Client(stack.nc, stack.settings)
    records = await client.artifacts(job_id)
    assert records, f"job {job_id} has no artifacts"
    for record in records:
        out = stack.tmp_path / "downloads" / f"{job_id}-{record.kind}"
        out.parent.mkdir(parents=True, exist_ok=True)
        await client.download(job_id, record.kind, out)
        assert hashlib.sha256(out.read_bytes()).hexdigest() == record.sha256
