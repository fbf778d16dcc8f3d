"""The scheduler and the agents: start and cancel requests, and the heartbeat
each node keeps in the `lorafleet_nodes` bucket."""

from __future__ import annotations

import datetime as dt
import enum

import msgspec

from lorafleet_schemas.messages.artifacts import ArtifactKind
from lorafleet_schemas.messages.catalog import ModelRecord
from lorafleet_schemas.messages.fields import Sha256Hex, SubjectToken
from lorafleet_schemas.messages.jobs import CheckpointRef, TrainerParams
from lorafleet_schemas.messages.serving import EngineRef


class StartRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """`lorafleet.node.<node>.start`: train this job.

    The node requests are strict and leave out what is at its default: a
    newer scheduler's new field reaches an older agent only when a job uses
    it, and is then refused naming it (rather than the job trained without
    it, an evaluation set ignored, say); any other job still runs there.
    """

    job_id: str
    attempt: int
    model: ModelRecord
    gpu_memory_mib: int
    #: Object name in `lorafleet_datasets`; the agent checks its sha256.
    dataset: str
    dataset_sha256: Sha256Hex
    params: TrainerParams
    artifacts: list[ArtifactKind]
    #: Start from this checkpoint (the job's own newest, or another job's
    #: checkpoint or adapter); None: from the base weights.
    resume: CheckpointRef | None = None
    #: JobSpec.serve: load the adapter into the node's engines when done.
    serve: bool | None = None
    #: The evaluation set's object in `lorafleet_datasets` (JobRecord.eval_dataset),
    #: fetched and checked against its sha256 as the dataset; None: none.
    eval_dataset: str | None = None
    eval_dataset_sha256: Sha256Hex | None = None


class StartReply(msgspec.Struct, kw_only=True):
    accepted: bool
    #: Why not, when not accepted.
    reason: str = ""
    #: The job the node is busy with, when busy.
    running_job: str | None = None
    #: The agent's clock when it took the job: a heartbeat of the node's
    #: composed no later says nothing of the job (reconcile; a beat that
    #: reaches the bucket late, after the dispatch, once read as "the agent
    #: no longer runs the job": nemesis seed 15). None: an older agent.
    accepted_at: dt.datetime | None = None
    #: The same moment on no clock: the agent process (its heartbeats'
    #: `started_at`) and the count of beats it had composed; its beats
    #: numbered above it are the ones composed after (0: it took the job
    #: before its first beat). Reconcile prefers it to `accepted_at`, which a
    #: step of the node's clock moves. None: an older agent.
    agent_started_at: dt.datetime | None = None
    accepted_beat: int | None = None


class NodeCancelRequest(
    msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True
):
    """`lorafleet.node.<node>.cancel`."""

    job_id: str
    reason: str = ""


class NodeCancelReply(msgspec.Struct, kw_only=True):
    #: True when the job was running there and is now stopped.
    stopped: bool


class NodeCheckpointRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`lorafleet.node.<node>.checkpoint`: a checkpoint of the job after its
    next optimizer step (its node drained with its training moved: the job
    resumes elsewhere from it). It comes as any checkpoint does."""

    job_id: str
    attempt: int


class NodeCheckpointReply(msgspec.Struct, kw_only=True):
    #: True when the job's trainer runs there and was asked.
    asked: bool
    #: Why not, when not.
    reason: str = ""


class Card(msgspec.Struct, kw_only=True):
    index: int
    name: str
    total_mib: int
    free_mib: int


class EnginesInstalled(msgspec.Struct, kw_only=True):
    vllm: list[str] = msgspec.field(default_factory=list)
    #: The newest llama.cpp release tag installed (b1234), if any.
    llamacpp: str | None = None


class Heartbeat(msgspec.Struct, kw_only=True):
    """The value of key `<node>` in KV `lorafleet_nodes`; it expires after `ttl_s`."""

    node: str
    version: str
    started_at: dt.datetime
    time: dt.datetime
    cards: list[Card] = msgspec.field(default_factory=list)
    engines: EnginesInstalled = msgspec.field(default_factory=EnginesInstalled)
    #: The job the agent is running, if any.
    job: str | None = None
    #: The agent trains on the CPU when it has no card (embedded default).
    cpu_training: bool = False
    heartbeat_s: float = 1.0
    ttl_s: int = 3
    #: The engines running on the node, each with the adapters it has loaded.
    serving: list[EngineRef] = msgspec.field(default_factory=list)
    #: This agent process's count of beats composed (its first is 1): with
    #: `started_at`, the order of its beats on no clock (StartReply.accepted_beat).
    #: 0: an older agent.
    beat: int = 0


class NodeSchedule(enum.StrEnum):
    """What the operator allows on a node (`lorafleet nodes cordon|drain|uncordon`).

    open: training and serving. cordoned: no new training (a job there
    finishes); serving untouched. drained: cordoned, and its placed
    replicas placed elsewhere first, then unloaded here; a training job
    there finishes, or with `move_training` resumes elsewhere.
    """

    OPEN = "open"
    CORDONED = "cordoned"
    DRAINED = "drained"


class NodeMark(msgspec.Struct, kw_only=True):
    """The value of key `<node>` in KV `lorafleet_node_marks` (no key: open).
    Kept until uncordoned, whether or not the node is alive."""

    node: str
    schedule: NodeSchedule
    time: dt.datetime
    #: Drained only: its training jobs are stopped there and resume elsewhere
    #: (NodeScheduleRequest.move_training); kept so that a new leader, and a
    #: job sent there just before the mark, are moved too.
    move_training: bool = False
    #: With move_training: a job with no checkpoint moves too, from step 0.
    force: bool = False


class NodeScheduleRequest(
    msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True
):
    """`lorafleet.api.nodes.schedule`: cordon, drain or uncordon (open) a node.
    Any node name is taken: a node may be marked before its agent starts."""

    node: SubjectToken
    schedule: NodeSchedule
    #: Drained only: each training job on the node (starting, preparing or
    #: running) is stopped there and queued again, a new attempt that does
    #: not use up the job's own, to resume on another node from its newest
    #: checkpoint. A job in converting or uploading, or submitted for this
    #: node, finishes there. Refused (nothing changed) while a job that has
    #: trained has no checkpoint to resume from, unless `force`.
    move_training: bool = False
    #: With move_training: move a job with no checkpoint too; it starts
    #: again from step 0 elsewhere.
    force: bool = False


class NodeInfo(msgspec.Struct, kw_only=True):
    heartbeat: Heartbeat
    alive: bool
    schedule: NodeSchedule = NodeSchedule.OPEN
    #: Drained with move_training: its training jobs resume elsewhere.
    move_training: bool = False
    #: In `api.nodes.schedule`'s answer only: the jobs on the node that this
    #: mark moves (they resume elsewhere) ...
    moving: list[str] = msgspec.field(default_factory=list)
    #: ... and those that stay there to finish, each with why.
    staying: dict[str, str] = msgspec.field(default_factory=dict)


class NodeListRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class NodeList(msgspec.Struct, kw_only=True):
    nodes: list[NodeInfo]
