"""Reconcile: the jobs the recorder holds on nodes against what the nodes say
they run, as plain functions over plain data (no bus, no clock: `now` comes
from the caller).

A job held on a live node that runs nothing, past `grace_s`, was lost by the
agent, unless it is a `starting` job this scheduler did not send: that
start is sent again, same attempt. A job on a node that is not alive was
lost with it. A job a node runs that the recorder holds final there is
cancelled on the node. A lost job is requeued with attempts left, else
failed (`lorafleet.states.loss_outcome`). A training job on a node drained
with move_training is moved (`training_moves`). Why: scheduler/DESIGN.md.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from lorafleet.states import FINAL, MOVABLE, ON_NODE
from lorafleet_schemas.messages import (
    CheckpointRef,
    Heartbeat,
    JobRecord,
    JobState,
    StartReply,
)
from lorafleet_services.scheduler.node_table import Node, utc_hms
from lorafleet_services.scheduler.placement import is_delivered

#: Seconds after the scheduler first sees a job on a node before a heartbeat
#: without it counts as "the agent lost it": the agent needs a moment to take
#: the start request and beat again. The effective grace is at least two of
#: the node's own heartbeat periods.
RECONCILE_GRACE_S = 2.0
#: Seconds a job the same agent stopped naming (it ended there) may stay
#: active in the recorder before reconcile fails it: the agent lets go only
#: once its final report is stored in the status stream, but the recorder
#: applies it later, by seconds when that stream or its consumer has just
#: changed leader on a cluster.
LET_GO_GRACE_S = 30.0


def node_lost_cause(node: Node) -> str:
    """Why a job requeued after its node's loss went back to the queue."""
    return f"node {node.name} was lost (last beat {utc_hms(node.heartbeat.time)})"


def agent_lost_cause(node: str) -> str:
    return f"the agent on {node} no longer runs the job (it restarted, or the job ended there)"


def node_lost_message(node: Node) -> str:
    return (
        f"node {node.name} stopped heartbeating (last beat {utc_hms(node.heartbeat.time)}); "
        "the job was lost with it — submit it again"
    )


def jobs_lost_with(
    node: Node, on_node_jobs: Iterable[JobRecord], first_seen: Mapping[str, float] | None = None
) -> list[JobRecord]:
    """The recorder's jobs on `node` that die with it (delivered uploads survive)."""
    seen = first_seen or {}
    return [
        j
        for j in on_node_jobs
        if j.node == node.name and j.state in ON_NODE and not is_delivered(j, node, seen.get(j.id))
    ]


@dataclass(frozen=True, slots=True)
class FailJob:
    """`job` was lost (not by its own fault): requeue it with attempts left,
    saying `cause`, else fail it with `message` (RecorderClient.lose_job)."""

    job: JobRecord
    message: str
    cause: str = ""


@dataclass(frozen=True, slots=True)
class ResendStart:
    """Send `job`'s start to `node` again (same attempt): it may never have arrived."""

    job: JobRecord
    node: str


@dataclass(frozen=True, slots=True)
class CheckRunning:
    """`node` runs `job_id`, which the recorder does not hold active there:
    look it up, and cancel it on the node when the recorder holds it final."""

    node: str
    job_id: str


@dataclass
class Reconciliation:
    fail: list[FailJob] = field(default_factory=list)
    resend: list[ResendStart] = field(default_factory=list)
    check: list[CheckRunning] = field(default_factory=list)


def reconcile(
    active_jobs: Sequence[JobRecord],
    nodes: Mapping[str, Node],
    now: float,
    first_seen: Mapping[str, float],
    grace_s: float = RECONCILE_GRACE_S,
    view_since: float = -math.inf,
    sent_here: Container[str] | None = None,
    taken: Mapping[str, Taken] | None = None,
) -> Reconciliation:
    """Compare what the recorder holds on nodes with what the nodes say they run.

    active_jobs: the recorder's jobs in an on-node state. first_seen: job id
    -> monotonic seconds when this scheduler sent it or first saw it on its
    node (the grace runs from there; the caller records it). A job missing
    from `first_seen` is given its grace from `now`. Only call this once the
    node table holds the KV bucket's current content: a node missing from
    it is a node that is gone. sent_here: the jobs whose start this scheduler
    sent (or sent again); a `starting` job not in it is sent its start again
    instead of lost. None: every start counts as sent. taken: job id -> when
    the agent took the job (its start reply): a beat of the node composed no
    later says nothing of the job, however late it arrives.
    """
    out = Reconciliation()
    held: set[tuple[str, str]] = set()
    for job in active_jobs:
        if job.state not in ON_NODE or job.node is None:
            continue
        held.add((job.node, job.id))
        node = nodes.get(job.node)
        delivered = is_delivered(job, node, first_seen.get(job.id))
        if node is None or not node.alive:
            if node is None:
                msg = (
                    f"node {job.node} is not heartbeating; the job was lost with it — "
                    "submit it again"
                )
                out.fail.append(FailJob(job, msg, f"node {job.node} is not heartbeating"))
            elif not delivered:
                out.fail.append(FailJob(job, node_lost_message(node), node_lost_cause(node)))
            continue
        if node.running == job.id:
            continue
        if job.state is JobState.UPLOADING:
            if not delivered:
                out.fail.append(_agent_lost(job, job.node))
            continue
        if node.let_go == job.id and now - node.let_go_at < LET_GO_GRACE_S:
            continue  # it ended there: its final report is on its way to the recorder
        since = max(first_seen.get(job.id, now), view_since)
        if _beat_says_lost(node, now, since, grace_s, (taken or {}).get(job.id)):
            unsent = sent_here is not None and job.id not in sent_here
            if job.state is JobState.STARTING and unsent:
                out.resend.append(ResendStart(job, job.node))
            else:
                out.fail.append(_agent_lost(job, job.node))
    for node in nodes.values():
        if node.alive and node.running is not None and (node.name, node.running) not in held:
            out.check.append(CheckRunning(node.name, node.running))
    return out


@dataclass(frozen=True, slots=True)
class Taken:
    """When an agent took a job, from its start reply: the agent process and
    its count of beats composed by then; from an agent older than the count,
    its clock."""

    at: dt.datetime | None
    agent_started_at: dt.datetime | None = None
    beat: int | None = None

    @classmethod
    def of(cls, reply: StartReply) -> Taken:
        return cls(reply.accepted_at, reply.agent_started_at, reply.accepted_beat)


def composed_after(hb: Heartbeat, taken: Taken) -> bool:
    """Whether the beat was composed after the agent took the job. By the
    beat count where both say one, on no clock: a node's clock stepped back
    an hour once made every beat of the next hour "before" the job, and a
    job the agent had lost stayed running that long. A beat of another agent
    process is after (one started since; the grace covers a dead one's beat
    stored late). Else by the agent's clock."""
    if taken.beat is not None and hb.beat:
        return hb.started_at != taken.agent_started_at or hb.beat > taken.beat
    return taken.at is None or hb.time > taken.at


def _beat_says_lost(
    node: Node, now: float, since: float, grace_s: float, taken: Taken | None
) -> bool:
    """The node's beat, without the job sent (or seen there) at `since`, says
    the agent lost it: past the grace (at least two beat periods), received a
    beat period after `since` and composed after the agent took the job
    (`composed_after`; a beat composed before can be stored late)."""
    if taken is not None and not composed_after(node.heartbeat, taken):
        return False
    grace = max(grace_s, 2 * node.heartbeat.heartbeat_s)
    return now - since >= grace and node.last_seen - since >= node.heartbeat.heartbeat_s


def _agent_lost(job: JobRecord, node: str) -> FailJob:
    return FailJob(job, agent_lost_message(node), agent_lost_cause(node))


def deliveries_never_stored(
    on_node: Iterable[JobRecord],
    nodes: Mapping[str, Node],
    first_seen: Mapping[str, float],
    delivered_at: dict[str, float],
    now: float,
    store_wait_s: float,
) -> list[FailJob]:
    """The `uploading` jobs delivered (`is_delivered`) `store_wait_s` or more
    ago and still not stored: lost (nemesis seed 17). `delivered_at` (job id ->
    when this scheduler first saw it delivered) is the caller's, kept here."""
    out: list[FailJob] = []
    for job in on_node:
        if not is_delivered(job, nodes.get(job.node or ""), first_seen.get(job.id)):
            delivered_at.pop(job.id, None)
        elif now - delivered_at.setdefault(job.id, now) >= store_wait_s:
            out.append(never_stored(job, store_wait_s))
    return out


def never_stored(job: JobRecord, store_wait_s: float) -> FailJob:
    """`job`'s agent delivered its artifacts `store_wait_s` ago and the
    artifact-store has stored them not, nor failed the job: lost."""
    return FailJob(
        job,
        f"node {job.node} delivered the job's artifacts and the artifact-store did not store "
        f"them within {store_wait_s:.0f} s (LORAFLEET_DELIVERY_STORE_WAIT_S): check its log "
        "(artifact.rejected) and that it runs, then `lorafleet resume JOB`",
        f"its artifacts, delivered by {job.node}, were not stored within {store_wait_s:.0f} s",
    )


def agent_lost_message(node: str) -> str:
    return (
        f"the agent on {node} restarted and no longer runs this job "
        "(or never received it) — submit it again"
    )


def should_cancel_on_node(job: JobRecord | None, node: str | None = None) -> bool:
    """A node runs a job the recorder holds final (or does not know), or holds
    queued again (that run's attempt was given up), or, given `node`, holds on
    another node: stop it there."""
    if job is None or job.state in FINAL:
        return True
    if job.state is JobState.QUEUED and job.attempt > 0:
        return True
    return node is not None and job.node is not None and job.node != node


def drained_cause(node: str) -> str:
    """Why a job moved off a drained node went back to the queue."""
    return f"node {node} was drained with move_training"


def why_training_stays(job: JobRecord, force: bool) -> str | None:
    """Why `job`, on a node drained with move_training, stays there to finish
    (None: it moves). Without `force` a job that has trained and has no
    checkpoint stays: moved, it would start again from step 0 and lose every
    step it took, which an operator moving work off a node does not expect
    (kubectl drain refuses what it cannot move safely the same way)."""
    if job.state not in MOVABLE:  # its training is over: moved, it would train again
        return f"it is {job.state.value}: its training is over, so it finishes on {job.node}"
    if job.requested_node is not None and job.requested_node == job.node:
        return f"it was submitted for node {job.node} (node), so it can run nowhere else"
    if job.checkpoint is None and job.step > 0 and not force:
        return (
            f"it has no checkpoint to resume from: moved, it would start again from step 0 "
            f"and lose its {job.step} steps; wait for its first checkpoint "
            "(params.checkpoint_every_s / checkpoint_every_steps), move it anyway with "
            "force (--force), or drain without move_training and let it finish"
        )
    return None


def training_moves(
    on_node_jobs: Iterable[JobRecord], nodes: Mapping[str, Node], moves: Mapping[str, bool]
) -> list[JobRecord]:
    """The jobs to move now: on a live node drained with move_training
    (`moves`: node -> force), and not staying (`why_training_stays`). A job
    on a node that is not alive is the loss's (jobs_lost_with)."""
    out = []
    for job in on_node_jobs:
        if job.node is None or job.node not in moves:
            continue
        node = nodes.get(job.node)
        if node is None or not node.alive:
            continue
        if why_training_stays(job, moves[job.node]) is None:
            out.append(job)
    return out


def resume_ref(job: JobRecord, other: JobRecord | None) -> CheckpointRef | None:
    """What `job` starts from: its own newest checkpoint (continue), else
    the newest checkpoint, else the adapter, of `other` (its resume_from:
    weights only); None: nothing (from the base weights, or, with a
    resume_from, nothing stored any more)."""
    if job.checkpoint is not None:
        return job.checkpoint
    if other is None:
        return None
    return other.checkpoint or other.adapter
