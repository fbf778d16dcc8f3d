"""The scheduler's node table, as plain data (no bus, no clock: `now` comes
from the caller): which nodes are alive, from their heartbeats, and which
were lost.

A node is *alive* from its first heartbeat until its key is deleted (a
clean stop) or its beat expires (the KV MaxAge marker, or the sweep: no
beat for `timeout_s`). nodes.py feeds it from the KV watch.
"""

from __future__ import annotations

import datetime as dt
import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from lorafleet_schemas.messages import (
    Card,
    Heartbeat,
    NodeInfo,
    NodeSchedule,
)

#: Seconds the safety-net sweep waits beyond the node timeout before it calls a
#: node lost: the KV expiry marker (which comes at the timeout) is the primary
#: signal, and one late beat should not lose a node.
SWEEP_MARGIN_S = 0.5
#: Seconds a lost node stays in the table (and in nodes.list, as not alive)
#: so that a job waiting for it can say when it was last heard from.
FORGET_AFTER_S = 24 * 3600.0


def utc_hms(t: dt.datetime) -> str:
    """`12:01:05 UTC`: how a person reads a heartbeat time in a message."""
    return t.astimezone(dt.UTC).strftime("%H:%M:%S UTC")


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
    #: What the operator allows here (`NodeTable.marks`, KV `node_marks`).
    schedule: NodeSchedule = NodeSchedule.OPEN

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
    #: node -> its mark when not open (KV `node_marks`); kept for nodes not heard yet.
    marks: dict[str, NodeSchedule] = field(default_factory=dict)
    #: Drained nodes whose training moves elsewhere (NodeMark.move_training)
    #: -> whether a job with no checkpoint moves too (NodeMark.force).
    moves: dict[str, bool] = field(default_factory=dict)

    def mark(
        self, name: str, schedule: NodeSchedule, move_training: bool = False, force: bool = False
    ) -> None:
        """Cordon, drain or open `name` (whether or not it beats now);
        `move_training` (drained only): its training jobs resume elsewhere."""
        if schedule is NodeSchedule.OPEN:
            self.marks.pop(name, None)
        else:
            self.marks[name] = schedule
        if schedule is NodeSchedule.DRAINED and move_training:
            self.moves[name] = force
        else:
            self.moves.pop(name, None)
        if name in self.nodes:
            self.nodes[name].schedule = schedule

    def info(self, node: Node) -> NodeInfo:
        return NodeInfo(
            heartbeat=node.heartbeat,
            alive=node.alive,
            schedule=node.schedule,
            move_training=node.name in self.moves,
        )

    def beat(self, hb: Heartbeat, now: float) -> BeatChange:
        old = self.nodes.get(hb.node)
        same_agent = old is not None and old.heartbeat.started_at == hb.started_at
        since = old.agent_since if old is not None and same_agent else now
        node = Node(heartbeat=hb, last_seen=now, alive=True, agent_since=since)
        node.schedule = self.marks.get(hb.node, NodeSchedule.OPEN)
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
        return [self.info(n) for n in sorted(self.nodes.values(), key=lambda n: n.name)]


def lost_nodes(nodes: Iterable[Node], now: float, timeout_s: float) -> list[Node]:
    """The live nodes whose last beat is `timeout_s` or more seconds old."""
    return [n for n in nodes if n.alive and now - n.last_seen >= timeout_s]
