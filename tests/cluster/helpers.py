"""What the cluster tests share: finding leaders and connections, and the
checks every server-loss test makes."""

from __future__ import annotations

import hashlib

from lorafleet import Client
from lorafleet.natscluster import NatsCluster, stream_leader
from lorafleet_schemas.messages import JobState
from tests.eventually import eventually
from tests.procs import ServiceProcess
from tests.system.conftest import Stack, has_artifact_store

FINISHED = (JobState.DONE,) if has_artifact_store() else (JobState.DONE, JobState.UPLOADING)
#: The stand-in trains 100 steps of 0.1 s: long enough to outlive an
#: election (about 5 s) plus the node timeout, so a false loss would show.
TRAINING = {"LORAFLEET_STANDIN_STEPS": "100", "LORAFLEET_STANDIN_STEP_S": "0.1"}
#: Seconds a job may take to end on the cluster (elections included).
END_TIMEOUT_S = 60.0


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


def no_false_loss(stack: Stack, agent: ServiceProcess) -> None:
    """Nobody judged the node lost, and its agent never fenced itself."""
    for scheduler in stack.schedulers:
        assert scheduler.events("node.lost") == [], scheduler.events("node.lost")
        assert scheduler.events("job.lost") == [], scheduler.events("job.lost")
    assert agent.events("agent.fenced") == [], agent.events("agent.fenced")


async def assert_each_step_once(stack: Stack, job_id: str, steps: int) -> None:
    curve = await stack.curve(job_id)
    recorded = [p.step for p in curve.points]
    assert sorted(recorded) == list(range(1, steps + 1)), recorded


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
