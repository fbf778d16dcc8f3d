"""Cordon, drain and uncordon: the operator's marks on nodes.

A mark is fleet state, kept in KV `<prefix>_node_marks` (one key per
marked node, a NodeMark; no key: open) so that it outlasts every scheduler
and agent restart. Every replica watches the bucket into its node table
(`NodeTable.mark`); `api.nodes.schedule` (any replica) writes the key and
marks its own table at once, so its answer already shows it. What each
mark does is decided elsewhere, from the table: dispatch sends no new job
to a node not open (placement.py), and a drained node is no candidate for
an adapter's replicas, which are placed elsewhere before its own are
unloaded (replicas.py). A drain with `move_training` also moves the node's
training jobs: the leader's round requeues each and stops it there
(dispatch.py, `move_off_node`; which jobs: reconcile.training_moves). The
handler checks first, and refuses with nothing changed while a job would
lose its steps (no checkpoint) unless `force`.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import msgspec
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from lorafleet._recorder_client import RecorderClient
from lorafleet.errors import BadRequestError, ConflictError
from lorafleet.log import Event
from lorafleet.names import Names
from lorafleet.nats import _bus as bus
from lorafleet.nats._kv_watch import KeyWatch, removed
from lorafleet.states import ON_NODE
from lorafleet_schemas.messages import (
    Heartbeat,
    JobListRequest,
    JobRecord,
    NodeInfo,
    NodeMark,
    NodeSchedule,
    NodeScheduleRequest,
)
from lorafleet_services.scheduler.node_table import NodeTable
from lorafleet_services.scheduler.reconcile import why_training_stays

_EPOCH = dt.datetime.fromtimestamp(0, dt.UTC)


def mark_of(entry: KeyValue.Entry) -> NodeMark | None:
    """The mark a watched entry holds: a delete is `open`; None for a value
    that is no NodeMark (logged by the caller)."""
    if removed(entry.operation):
        return NodeMark(node=entry.key, schedule=NodeSchedule.OPEN, time=_EPOCH)
    try:
        return msgspec.json.decode(entry.value or b"", type=NodeMark)
    except msgspec.DecodeError:
        return None


def check_request(req: NodeScheduleRequest) -> None:
    """BadRequestError for options that do not go with the schedule asked."""
    if req.move_training and req.schedule is not NodeSchedule.DRAINED:
        raise BadRequestError(
            f"move_training moves a drained node's training; {req.schedule.value} keeps it "
            "there: drain the node (schedule drained), or leave move_training out",
            field="$.move_training",
        )
    if req.force and not req.move_training:
        raise BadRequestError(
            "force only goes with move_training (it moves a job with no checkpoint too)",
            field="$.force",
        )


def plan_moves(
    req: NodeScheduleRequest, on_node: list[JobRecord]
) -> tuple[list[str], dict[str, str]]:
    """The jobs on `req.node` that the mark moves, and those that stay (with
    why). ConflictError, naming each, when a job stays only for want of a
    checkpoint and `req.force` is not given: the operator asked to move it."""
    if not req.move_training:
        return [], {}
    moving: list[str] = []
    staying: dict[str, str] = {}
    blocked: list[str] = []
    for job in (j for j in on_node if j.node == req.node and j.state in ON_NODE):
        why = why_training_stays(job, req.force)
        if why is None:
            moving.append(job.id)
            continue
        staying[job.id] = why
        if why_training_stays(job, force=True) is None:
            blocked.append(f"job {job.id}: {why}")
    if blocked:
        raise ConflictError(
            f"nothing changed: node {req.node} runs " + "; ".join(blocked), field="$.force"
        )
    return moving, staying


class NodeMarks:
    """The marks bucket, watched into `table`, and the schedule handler."""

    def __init__(
        self,
        js: JetStreamContext,
        names: Names,
        table: NodeTable,
        recorder: RecorderClient,
        logger: Any,
    ) -> None:
        self.js = js
        self.recorder = recorder
        self.names = names
        self.table = table
        self.logger = logger
        self.watch = KeyWatch(js, names.node_marks_bucket, ">", self.on_entry, logger)

    def on_entry(self, entry: KeyValue.Entry | None) -> None:
        if entry is None:
            return
        mark = mark_of(entry)
        if mark is None:
            self.logger.warning(Event.NATS_ERROR, node=entry.key, error="bad node mark")
            return
        self.table.mark(entry.key, mark.schedule, mark.move_training, mark.force)

    async def schedule(self, req: NodeScheduleRequest) -> NodeInfo:
        """Mark `req.node`; answer with the node as this replica now sees it
        (and, with move_training, which of its jobs move and which stay)."""
        check_request(req)
        moving: list[str] = []
        staying: dict[str, str] = {}
        if req.move_training:
            on_node = await self.recorder.list_jobs(
                JobListRequest(states=sorted(ON_NODE), node=req.node, limit=1000)
            )
            moving, staying = plan_moves(req, on_node)
        kv = await self.js.key_value(self.names.node_marks_bucket)
        if req.schedule is NodeSchedule.OPEN:
            await kv.delete(req.node)
        else:
            mark = NodeMark(
                node=req.node,
                schedule=req.schedule,
                time=dt.datetime.now(dt.UTC),
                move_training=req.move_training,
                force=req.force,
            )
            await kv.put(req.node, bus.encode(mark))
        self.table.mark(req.node, req.schedule, req.move_training, req.force)
        self.logger.info(
            Event.NODE_MARKED,
            node=req.node,
            state=req.schedule.value,
            message=f"moving {', '.join(moving)}" if moving else "",
        )
        node = self.table.nodes.get(req.node)
        if node is None:
            info = NodeInfo(heartbeat=_unheard(req.node), alive=False, schedule=req.schedule)
            info.move_training = req.move_training
        else:
            info = self.table.info(node)
        info.moving, info.staying = moving, staying
        return info


def _unheard(node: str) -> Heartbeat:
    """A heartbeat-shaped placeholder for a node marked before its first beat."""
    return Heartbeat(node=node, version="", started_at=_EPOCH, time=_EPOCH)
