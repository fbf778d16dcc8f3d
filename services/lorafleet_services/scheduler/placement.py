"""Where a queued job goes, as plain functions over plain data (no bus, no
clock: every function takes `now` from its caller, so tests drive time by
hand).

A node is *idle* when it is alive, its last beat names no job and the
recorder holds none on it (`busy_nodes`): one job per node. A job named for a node
waits for that node; one without goes to the live idle card node whose best
card has the most MiB free, a CPU-training node only when no card node is
alive; a job that cannot go anywhere stays queued saying what it waits for.
A cordoned or drained node takes no new job (one it runs finishes).
A *delivered* `uploading` job neither holds its node nor is lost with it,
unless the agent restarted since (`CLOCK_SKEW_S`). Why each rule:
scheduler/DESIGN.md.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from lorafleet.states import ON_NODE
from lorafleet_schemas.messages import (
    JobRecord,
    JobState,
    NodeSchedule,
)
from lorafleet_services.scheduler.node_table import Node, utc_hms

#: Seconds by which a node's clock may differ from the recorder's before an
#: agent `started_at` later than a job's counts as a restart. A job reaches
#: `uploading` only after training, which takes longer than this.
CLOCK_SKEW_S = 5.0


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
    if node.schedule is not NodeSchedule.OPEN:
        return (
            f"waiting for node {name}: it is {node.schedule.value} (no new training there; "
            f"`lorafleet nodes uncordon {name}`, or submit without a node)"
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
        open_ = n.schedule is NodeSchedule.OPEN
        return (
            open_ and n.alive and n.running is None and n.name not in busy and n.name not in taken
        )

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
    if all(n.schedule is not NodeSchedule.OPEN for n in alive):
        return f"{want}: every live node is cordoned (`lorafleet nodes uncordon NODE`)"
    cards = [(c, n.name) for n in alive for c in n.heartbeat.cards]
    if cards:
        card, name = max(cards, key=lambda cn: cn[0].free_mib)
        return f"{want}: the most free is GPU {card.index} on {name} with {card.free_mib} MiB"
    return f"{want}: every live node is busy"
