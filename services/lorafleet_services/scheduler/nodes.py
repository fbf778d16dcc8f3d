"""The node watcher: entries of KV `<prefix>_nodes` -> the node table.

A `KeyWatch` on the bucket hands every entry to `NodeWatcher.on_entry`:
first every key's last value, then `None` (the table is complete: `synced`),
then every beat, delete (`node.left`) and expiry marker (`node.lost`); the
sweep is the safety net. A lost node is queued for the leader
(`take_lost`). A node is lost only when its beats could have been seen and
were not: while the view is blind or just back, departures are left to the
sweep, which judges silence as of this replica's last write that reached
the majority (scheduler/DESIGN.md, "Rules every change keeps"). Nothing
here talks to NATS, so the tests feed it entries by hand.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import msgspec
from nats.js.kv import KeyValue

from lorafleet import metrics
from lorafleet.log import Event
from lorafleet.names import KV_DEL
from lorafleet.nats._kv_watch import removed
from lorafleet_schemas.messages import Heartbeat
from lorafleet_services.scheduler.node_table import (
    SWEEP_MARGIN_S,
    BeatChange,
    Node,
    NodeTable,
    utc_hms,
)


class Departure(enum.Enum):
    """Why a node's key went away; the value is what the log says."""

    LEFT = "stopped cleanly (heartbeat deleted)"
    EXPIRED = "heartbeat expired"
    SILENT = "no heartbeat"


def departure(operation: str | None) -> Departure | None:
    """What a KV entry's operation says about its node (None: a beat)."""
    if not removed(operation):
        return None
    if operation == KV_DEL:
        return Departure.LEFT
    return Departure.EXPIRED


class NodeWatcher:
    """The node table as the nodes bucket tells it.

    node_timeout_s: seconds of silence after which the sweep loses a node,
    and how long after our own reconnect expiry markers are left to it.
    clock: monotonic seconds. wake: called when dispatch may have something
    new to do (a node came up, went idle, was lost, or the table is complete).
    holds_lease: whether this replica holds the leader's lease now (its last
    write reached the majority within it); default always.
    """

    def __init__(
        self,
        node_timeout_s: float,
        clock: Callable[[], float],
        logger: Any,
        wake: Callable[[], None],
        holds_lease: Callable[[], bool] = lambda: True,
    ) -> None:
        self.node_timeout_s = node_timeout_s
        self.clock = clock
        self.logger = logger
        self.wake = wake
        self.holds_lease = holds_lease
        self.table = NodeTable()
        #: True once the watcher has delivered the bucket's current content.
        self.synced = False
        self._lost: list[Node] = []
        self._reconnected_at: float | None = None
        #: True while our view of the bucket is blind (KeyWatch's probe).
        self.blind = False
        #: Key -> the revision (stream sequence) of its last entry applied.
        self._revisions: dict[str, int] = {}
        #: Key -> a departure seen while blind or just back, and when (clock):
        #: applied by the sweep a node timeout later unless a beat came since.
        self._deferred: dict[str, tuple[Departure, float]] = {}

    def on_entry(self, entry: KeyValue.Entry | None) -> None:
        if entry is None:
            # The bucket's current content is in: a node missing now is gone.
            if not self.synced:
                self.synced = True
                self.wake()
            return
        if self._stale(entry):
            return
        why = departure(entry.operation)
        if why is not None:
            self._on_departure(entry.key, why)
            return
        try:
            hb = msgspec.json.decode(entry.value or b"", type=Heartbeat)
        except msgspec.DecodeError as e:
            self.logger.warning(Event.NATS_ERROR, node=entry.key, error=f"bad heartbeat: {e}")
            return
        self._deferred.pop(entry.key, None)
        change = self.table.beat(hb, self.clock())
        if change is BeatChange.UP:
            self.logger.info(
                Event.NODE_UP, node=hb.node, message=f"{len(hb.cards)} cards", job_id=hb.job
            )
            self.wake()
        elif change is BeatChange.IDLE:
            self.wake()

    def _stale(self, entry: KeyValue.Entry) -> bool:
        """An entry no newer than the key's last one applied: a rebuilt watch
        whose consumer reads a copy behind the leader delivers older beats.
        Taken as news, such a beat "arrived now" naming the job the node ran
        before, and reconcile would fail the job it runs now
        (tests/scheduler/test_nodes.py pins it)."""
        if entry.revision is None:
            return False
        if entry.revision <= self._revisions.get(entry.key, 0):
            return True
        self._revisions[entry.key] = entry.revision
        return False

    def _on_departure(self, name: str, why: Departure) -> None:
        if self.blind or self._in_reconnect_grace():
            # The server may have expired beats that could not reach it while
            # it was down (and a fresh watch redelivers old deletes): the
            # sweep judges these nodes from now on. Not node.lost: whoever
            # counts those (an alert over the logs) counts real losses only.
            self._defer(name, why, "while our view was blind or just back")
            return
        if why is Departure.EXPIRED and not self.holds_lease():
            # An expiry taken as a loss by a replica without the lease: in a
            # member's cut-off both replicas were between leases and judged
            # untouched nodes lost whose beats came 0.1-1 s after the marker
            # (nemesis, issue 33). The leader's lease proves that its member
            # reaches the majority; a marker it reads is the majority's.
            self._defer(name, why, "while this replica holds no lease")
            return
        node = self.table.expire(name)
        if node is not None:
            self._gone(node, why)

    def _defer(self, name: str, why: Departure, when: str) -> None:
        """Leave a departure to the sweep: applied a node timeout later unless a beat comes."""
        self.logger.info(
            Event.NODE_DEPARTURE_DEFERRED,
            node=name,
            message=f"{why.value} {when}: left to the sweep",
        )
        self._deferred[name] = (why, self.clock())

    def _gone(self, node: Node, why: Departure) -> None:
        metrics.node_departed(why.name.lower())
        self.logger.warning(
            Event.NODE_LEFT if why is Departure.LEFT else Event.NODE_LOST,
            node=node.name,
            job_id=node.running,
            message=f"{why.value}; last beat {utc_hms(node.heartbeat.time)}",
        )
        self._lost.append(node)
        self.wake()

    def _in_reconnect_grace(self) -> bool:
        since = self._reconnected_at
        return since is not None and self.clock() - since < self.node_timeout_s

    def reconnected(self) -> None:
        """Our connection came back: forgive the silence (it was ours, not
        the nodes'), and leave expiry markers to the sweep for a while."""
        self._reconnected_at = self.clock()
        self.table.touch_all(self._reconnected_at)

    def leading(self) -> None:
        """This replica became leader: count every live node as just seen. It
        judged nobody before, and a leader change comes with the cluster's
        disturbance, when its copy of the bucket may lag the beats (a new
        leader's consumer may read a copy behind). A node that did die is
        lost one node_timeout_s later."""
        self.table.touch_all(self.clock())

    def view_changed(self, seeing: bool) -> None:
        """The KeyWatch's verdict on our view of the bucket. Blind: judge
        nobody. Seeing again: the silence was the bucket's, not the nodes'."""
        if seeing and self.blind:
            self.reconnected()
        self.blind = not seeing

    def sweep(self, now: float, majority_at: float | None = None) -> None:
        """Lose every live node silent for longer than the timeout (the safety
        net); nobody while the view is blind. `majority_at`: when this replica
        last reached the cluster's majority (default `now`); silence is judged
        as of then, since a member cut off from the others delivers no beat
        and still answers as if nothing were wrong."""
        if self.blind:
            return
        at = now if majority_at is None else min(now, majority_at)
        for node in self.table.sweep(at, self.node_timeout_s):
            self._gone(node, Departure.SILENT)
        # A departure left to the sweep is the sweep's only way to lose a node
        # on a replica that does not lead (it judges no silence), else its
        # nodes.list would show an expired node alive for ever.
        for name, (why, seen_at) in list(self._deferred.items()):
            if now - seen_at >= self.node_timeout_s + SWEEP_MARGIN_S:
                del self._deferred[name]
                if (expired := self.table.expire(name)) is not None:
                    self._gone(expired, why)

    def take_lost(self) -> list[Node]:
        """The nodes lost since the last call, whose jobs are to be failed."""
        lost, self._lost = self._lost, []
        return lost
