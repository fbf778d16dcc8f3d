"""The scheduler's rules, as plain functions over plain data (no bus, no clock).

Every function takes `now` (monotonic seconds) from its caller, so the tests
drive time by hand. The node watcher (nodes.py) and the dispatcher
(dispatch.py) feed these functions with what the KV watch and the recorder
say, and apply their answers through the recorder's compare-and-set;
nothing here talks to NATS.

The rules, in one place:

- A node is *alive* from its first heartbeat until its key is deleted (a
  clean stop) or its beat expires (the KV MaxAge marker, or the sweep: no
  beat for `timeout_s`).
- A node is *idle* when it is alive, its last heartbeat names no job, and
  the recorder holds no job on it (`busy`). One job per node.
- A job named for a node goes to that node when it is idle and, if the node
  has cards, one of them has the job's MiB free. A job without a node goes
  to the live idle card node whose best card has the most MiB free (at
  least the job's); a CPU-training node takes such a job only when no card
  node is alive at all (the embedded default: one machine, no GPU).
- A job that cannot go anywhere stays queued with a message saying what it
  waits for.
- Reconcile: a job the recorder holds on a live node whose heartbeats say
  it runs nothing, past `grace_s` after the scheduler first saw it there,
  was lost by the agent (restarted, or never got it) — except a `starting`
  job whose start this scheduler did not send itself (a leader before it
  may have died between the move to `starting` and the send): its start
  is sent again, same attempt (the agent takes a start idempotently by
  job and attempt), since a start that never arrived is not an attempt.
  A job on a node that is not alive was lost with the node. A job a node
  runs that the recorder does not hold active there is checked, and
  cancelled on the node if the recorder holds it final.
- A lost job (its node lost, its agent without it, a re-sent start
  refused) is not lost by its own fault: it goes back to the queue when it
  has attempts left, else fails with the message it always had
  (`lorafleet.states.loss_outcome`, applied by RecorderClient.lose_job).
- `uploading` is special: once the agent has delivered every chunk to the
  artifacts stream (JetStream keeps them) it drops the job from its
  heartbeat and the artifact-store finishes the job. Such a *delivered* job
  neither holds its node nor is lost with it — unless the agent restarted
  after the job was sent, which means the delivery may have been cut short.
  A restart is what the scheduler saw itself (the node's `started_at`
  changed after it first saw the job there) or, for jobs sent before this
  scheduler started, an agent `started_at` later than the job's by more
  than `CLOCK_SKEW_S` (the two times come from different machines' clocks).
"""

from __future__ import annotations

import datetime as dt
import enum
import math
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from lorafleet.states import FINAL, ON_NODE
from lorafleet_schemas.messages import (
    Card,
    CheckpointRef,
    Heartbeat,
    JobRecord,
    JobState,
    NodeInfo,
)

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
#: Seconds the safety-net sweep waits beyond the node timeout before it calls a
#: node lost: the KV expiry marker (which comes at the timeout) is the primary
#: signal, and one late beat should not lose a node.
SWEEP_MARGIN_S = 0.5
#: Seconds a lost node stays in the table (and in nodes.list, as not alive)
#: so that a job waiting for it can say when it was last heard from.
FORGET_AFTER_S = 24 * 3600.0
#: Seconds by which a node's clock may differ from the recorder's before an
#: agent `started_at` later than a job's counts as a restart. A job reaches
#: `uploading` only after training, which takes longer than this.
CLOCK_SKEW_S = 5.0


def utc_hms(t: dt.datetime) -> str:
    """`12:01:05 UTC`: how a person reads a heartbeat time in a message."""
    return t.astimezone(dt.UTC).strftime("%H:%M:%S UTC")


# --- the node table ---------------------------------------------------------


class BeatChange(enum.Enum):
    """What one heartbeat changed about its node."""

    #: First beat, or the first since the node was lost.
    UP = "up"
    #: The node was running a job and now runs none.
    IDLE = "idle"
    #: Nothing that matters to dispatch.
    SAME = "same"


@dataclass(slots=True)
class Node:
    """What the scheduler knows of one node."""

    heartbeat: Heartbeat
    #: Monotonic seconds when the last beat arrived.
    last_seen: float
    alive: bool = True
    #: Monotonic seconds when this agent process (its `started_at`) was first heard.
    agent_since: float = 0.0
    #: The job this agent named last before a beat that named another or none
    #: (it ended there), and when that beat arrived.
    let_go: str | None = None
    let_go_at: float = 0.0

    @property
    def name(self) -> str:
        return self.heartbeat.node

    @property
    def running(self) -> str | None:
        return self.heartbeat.job

    def best_card(self) -> Card | None:
        """The card with the most MiB free (lowest index on a tie), if any."""
        if not self.heartbeat.cards:
            return None
        return max(self.heartbeat.cards, key=lambda c: (c.free_mib, -c.index))

    def largest_card(self) -> Card | None:
        if not self.heartbeat.cards:
            return None
        return max(self.heartbeat.cards, key=lambda c: (c.total_mib, -c.index))


@dataclass
class NodeTable:
    """Every node heard from, alive or lost. Rebuilt from KV at each start."""

    nodes: dict[str, Node] = field(default_factory=dict)
    #: Monotonic seconds of the last touch_all (our view came back): reconcile's
    #: grace runs from there. -inf: never.
    touched_at: float = -math.inf

    def beat(self, hb: Heartbeat, now: float) -> BeatChange:
        old = self.nodes.get(hb.node)
        same_agent = old is not None and old.heartbeat.started_at == hb.started_at
        since = old.agent_since if old is not None and same_agent else now
        node = Node(heartbeat=hb, last_seen=now, alive=True, agent_since=since)
        if old is not None and same_agent:
            node.let_go, node.let_go_at = old.let_go, old.let_go_at
            if old.heartbeat.job is not None and hb.job != old.heartbeat.job:
                node.let_go, node.let_go_at = old.heartbeat.job, now
        self.nodes[hb.node] = node
        if old is None or not old.alive:
            return BeatChange.UP
        if old.heartbeat.job is not None and hb.job is None:
            return BeatChange.IDLE
        return BeatChange.SAME

    def expire(self, name: str) -> Node | None:
        """The node's beat expired: mark it lost; return it when it was alive."""
        node = self.nodes.get(name)
        if node is None or not node.alive:
            return None
        node.alive = False
        return node

    def sweep(self, now: float, timeout_s: float) -> list[Node]:
        """Mark (and return) every live node silent for `timeout_s` + SWEEP_MARGIN_S."""
        lost = lost_nodes(self.nodes.values(), now, timeout_s + SWEEP_MARGIN_S)
        for node in lost:
            node.alive = False
        for name in [n.name for n in self.nodes.values() if not n.alive]:
            if now - self.nodes[name].last_seen > FORGET_AFTER_S:
                del self.nodes[name]
        return lost

    def touch_all(self, now: float) -> None:
        """Count every live node as just seen: after the scheduler's own
        connection was down, silence says nothing about the nodes."""
        self.touched_at = now
        for node in self.nodes.values():
            if node.alive:
                node.last_seen = now

    def infos(self) -> list[NodeInfo]:
        return [
            NodeInfo(heartbeat=n.heartbeat, alive=n.alive)
            for n in sorted(self.nodes.values(), key=lambda n: n.name)
        ]


def lost_nodes(nodes: Iterable[Node], now: float, timeout_s: float) -> list[Node]:
    """The live nodes whose last beat is `timeout_s` or more seconds old."""
    return [n for n in nodes if n.alive and now - n.last_seen >= timeout_s]


# --- dispatch ---------------------------------------------------------------


def is_delivered(job: JobRecord, node: Node | None, first_seen: float | None = None) -> bool:
    """An `uploading` job whose agent has finished with it (see the module doc).

    first_seen: monotonic seconds when this scheduler first saw the job on
    its node, if it did.
    """
    if job.state is not JobState.UPLOADING or node is None:
        return False
    if node.running == job.id:
        return False
    if first_seen is not None and node.agent_since > first_seen:
        return False  # a new agent process since the job was on the node
    sent_at = job.started_at or job.created_at
    return node.heartbeat.started_at <= sent_at + dt.timedelta(seconds=CLOCK_SKEW_S)


def busy_nodes(
    on_node_jobs: Iterable[JobRecord],
    nodes: Mapping[str, Node],
    first_seen: Mapping[str, float] | None = None,
) -> dict[str, str]:
    """node -> a job the recorder holds on it (delivered uploads do not count)."""
    seen = first_seen or {}
    out: dict[str, str] = {}
    for job in on_node_jobs:
        if job.node is None or job.state not in ON_NODE:
            continue
        if is_delivered(job, nodes.get(job.node), seen.get(job.id)):
            continue
        out.setdefault(job.node, job.id)
    return out


@dataclass
class DispatchPlan:
    """What one dispatch round does: send these, leave those waiting (and why)."""

    #: (job, node) pairs, oldest job first; at most one per node.
    send: list[tuple[JobRecord, str]] = field(default_factory=list)
    #: job id -> why it stays queued.
    waiting: dict[str, str] = field(default_factory=dict)


def _named_node_wait(job: JobRecord, node: Node | None, busy_with: str | None) -> str | None:
    """Why `job` cannot go to its named node now; None when it can."""
    name = job.node
    if name is None:
        raise ValueError(f"job {job.id} names no node; plan it as a placed job")
    if node is None:
        return (
            f"waiting for node {name}: no agent of that name is heartbeating "
            f"(start `lorafleet agent --node {name}` there, or submit without a node)"
        )
    if not node.alive:
        return (
            f"waiting for node {name}: its agent stopped heartbeating "
            f"(last beat {utc_hms(node.heartbeat.time)})"
        )
    largest = node.largest_card()
    if largest is not None and largest.total_mib < job.gpu_memory_mib:
        return (
            f"no card on {name} has {job.gpu_memory_mib} MiB: the largest is GPU "
            f"{largest.index} ({largest.name}) with {largest.total_mib} MiB; "
            "ask for less memory or another node"
        )
    if largest is None and not node.heartbeat.cpu_training:
        return (
            f"waiting for node {name}: it reports no cards and does not train on the CPU; "
            "check its NVIDIA driver"
        )
    running = node.running or busy_with
    if running is not None:
        return f"waiting for node {name}: it is busy with job {running}"
    best = node.best_card()
    if best is not None and best.free_mib < job.gpu_memory_mib:
        return (
            f"waiting for node {name}: no card has {job.gpu_memory_mib} MiB free; "
            f"the most free is GPU {best.index} with {best.free_mib} MiB"
        )
    return None


def plan_dispatch(
    queued_jobs: Sequence[JobRecord],
    nodes: Mapping[str, Node],
    busy: Mapping[str, str],
    now: float,
) -> DispatchPlan:
    """Decide which queued jobs go where in this round.

    queued_jobs: queued jobs, oldest first (the order is kept: an older job
    gets a node before a newer one). nodes: the node table. busy: node ->
    a job the recorder holds on it (`busy_nodes`). now: monotonic seconds
    (kept for symmetry with the other rules; liveness is already in `nodes`).
    """
    del now
    plan = DispatchPlan()
    taken: set[str] = set()

    def idle(n: Node) -> bool:
        return n.alive and n.running is None and n.name not in busy and n.name not in taken

    any_card_node_alive = any(n.alive and n.heartbeat.cards for n in nodes.values())
    for job in queued_jobs:
        if job.state is not JobState.QUEUED:
            continue
        if job.node is not None:
            node = nodes.get(job.node)
            reason = _named_node_wait(job, node, busy.get(job.node))
            if reason is None and job.node in taken:
                reason = f"waiting for node {job.node}: an older job was just sent to it"
            if reason is not None:
                plan.waiting[job.id] = reason
                continue
            plan.send.append((job, job.node))
            taken.add(job.node)
            continue
        fits = [
            (card.free_mib, n.name)
            for n in nodes.values()
            if idle(n)
            and (card := n.best_card()) is not None
            and card.free_mib >= job.gpu_memory_mib
        ]
        if fits:
            # Most MiB free first; the name breaks ties so a plan is reproducible.
            _, name = min(fits, key=lambda f: (-f[0], f[1]))
            plan.send.append((job, name))
            taken.add(name)
            continue
        if not any_card_node_alive:
            cpu = sorted(n.name for n in nodes.values() if idle(n) and n.heartbeat.cpu_training)
            if cpu:
                plan.send.append((job, cpu[0]))
                taken.add(cpu[0])
                continue
        plan.waiting[job.id] = _placement_wait(job, nodes)
    return plan


def _placement_wait(job: JobRecord, nodes: Mapping[str, Node]) -> str:
    alive = [n for n in nodes.values() if n.alive]
    want = f"waiting for a live idle node with a card of {job.gpu_memory_mib} MiB free"
    if not alive:
        return f"{want}: no node is heartbeating"
    cards = [(c, n.name) for n in alive for c in n.heartbeat.cards]
    if cards:
        card, name = max(cards, key=lambda cn: cn[0].free_mib)
        return f"{want}: the most free is GPU {card.index} on {name} with {card.free_mib} MiB"
    return f"{want}: every live node is busy"


# --- node loss and reconcile ------------------------------------------------


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
) -> Reconciliation:
    """Compare what the recorder holds on nodes with what the nodes say they run.

    active_jobs: the recorder's jobs in an on-node state. first_seen: job id
    -> monotonic seconds when this scheduler sent it or first saw it on its
    node (the grace runs from there; the caller records it). A job missing
    from `first_seen` is given its grace from `now`. Only call this once the
    node table holds the KV bucket's current content: a node missing from
    it is a node that is gone. sent_here: the jobs whose start this scheduler
    sent (or sent again); a `starting` job not in it is sent its start again
    instead of lost. None: every start counts as sent.
    """
    out = Reconciliation()
    held: set[tuple[str, str]] = set()
    for job in active_jobs:
        if job.state not in ON_NODE or job.node is None:
            continue
        held.add((job.node, job.id))
        node = nodes.get(job.node)
        if node is None or not node.alive:
            if node is None:
                msg = (
                    f"node {job.node} is not heartbeating; the job was lost with it — "
                    "submit it again"
                )
                out.fail.append(FailJob(job, msg, f"node {job.node} is not heartbeating"))
            elif not is_delivered(job, node, first_seen.get(job.id)):
                out.fail.append(FailJob(job, node_lost_message(node), node_lost_cause(node)))
            continue
        if node.running == job.id:
            continue
        if job.state is JobState.UPLOADING:
            if not is_delivered(job, node, first_seen.get(job.id)):
                out.fail.append(_agent_lost(job, job.node))
            continue
        if node.let_go == job.id and now - node.let_go_at < LET_GO_GRACE_S:
            continue  # it ended there: its final report is on its way to the recorder
        grace = max(grace_s, 2 * node.heartbeat.heartbeat_s)
        since = max(first_seen.get(job.id, now), view_since)
        # The beat must also be newer than the grace: a beat that left the agent
        # before it took the job says nothing about it.
        if now - since >= grace and node.last_seen - since >= node.heartbeat.heartbeat_s:
            unsent = sent_here is not None and job.id not in sent_here
            if job.state is JobState.STARTING and unsent:
                out.resend.append(ResendStart(job, job.node))
            else:
                out.fail.append(_agent_lost(job, job.node))
    for node in nodes.values():
        if node.alive and node.running is not None and (node.name, node.running) not in held:
            out.check.append(CheckRunning(node.name, node.running))
    return out


def _agent_lost(job: JobRecord, node: str) -> FailJob:
    return FailJob(job, agent_lost_message(node), agent_lost_cause(node))


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
