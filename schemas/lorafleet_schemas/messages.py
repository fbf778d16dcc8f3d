"""Every message lorafleet puts on NATS, as msgspec Structs.

These are the wire shapes. The JSON Schemas in schemas/json/ are generated
from them (`python -m lorafleet_schemas.generate`); a test fails when the
checked-in files are stale. Rules for change: a new field always gets a
default, so that older senders stay valid; nothing is renamed in place.

Times are UTC datetimes, sizes are bytes unless the name says MiB, and
durations carry their unit in the name.
"""

from __future__ import annotations

import datetime as dt
import enum
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

# --- shared pieces ---------------------------------------------------------

#: A token safe inside a NATS subject: node names, job ids, artifact kinds.
SubjectToken = Annotated[
    str,
    Meta(
        pattern=r"^[A-Za-z0-9_-]{1,64}$",
        description="letters, digits, '-' and '_' only (it becomes part of a NATS subject)",
    ),
]
Sha256Hex = Annotated[str, Meta(pattern=r"^[0-9a-f]{64}$", description="lowercase hex sha256")]
PositiveMiB = Annotated[int, Meta(gt=0, description="MiB of one card")]


class JobState(enum.StrEnum):
    """Where a job is. `done`, `failed` and `cancelled` are final."""

    QUEUED = "queued"
    STARTING = "starting"
    PREPARING = "preparing"
    RUNNING = "running"
    CONVERTING = "converting"
    UPLOADING = "uploading"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


class Engine(enum.StrEnum):
    """The engine that serves a catalog model on the nodes."""

    VLLM = "vllm"
    LLAMACPP = "llamacpp"


class ArtifactKind(enum.StrEnum):
    """What a job makes: the PEFT adapter directory as tar.gz, and a GGUF file;
    and, while it trains, its newest checkpoint (a tar of the checkpoint
    directory: adapter, optimizer, scheduler and RNG states, data position),
    each superseding the one before."""

    PEFT = "peft"
    GGUF = "gguf"
    CHECKPOINT = "checkpoint"


class ErrorCode(enum.StrEnum):
    BAD_REQUEST = "bad_request"
    NOT_FOUND = "not_found"
    CONFLICT = "conflict"
    UNAVAILABLE = "unavailable"
    INTERNAL = "internal"


class ErrorBody(msgspec.Struct, kw_only=True):
    code: ErrorCode
    message: str
    #: The request field at fault, as a JSON path (`$.params.rank`), when one is.
    field: str | None = None


class ErrorReply(msgspec.Struct, kw_only=True):
    """Every failed request is answered with this body (and Nats-Service-Error headers)."""

    error: ErrorBody


# --- the catalog -----------------------------------------------------------


class ModelArchitecture(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What a memory estimate needs of a decoder model, from its config.json.

    `lorafleet models add` reads it from a local directory or the Hugging Face
    cache (`lorafleet.estimate.architecture_from_config`); the API takes it as
    given. Sizes are counts, not bytes.
    """

    num_hidden_layers: Annotated[int, Meta(ge=1)]
    hidden_size: Annotated[int, Meta(ge=1)]
    intermediate_size: Annotated[int, Meta(ge=1)]
    num_attention_heads: Annotated[int, Meta(ge=1)]
    num_key_value_heads: Annotated[int, Meta(ge=1)]
    vocab_size: Annotated[int, Meta(ge=1)]
    #: hidden_size / num_attention_heads unless the config says otherwise.
    head_dim: Annotated[int, Meta(ge=1)] | None = None
    #: The weights' parameter count; computed from the shapes when not given.
    parameters: Annotated[int, Meta(ge=1)] | None = None
    #: The dtype the weights are stored in (config.json's torch_dtype / dtype).
    weight_dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    tie_word_embeddings: bool = False
    #: q, k and v projections carry a bias (Qwen2 does).
    attention_bias: bool = False


class ModelSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A catalog entry: where a model's safetensors weights are, and what serves it.

    Exactly one of `hf_repo` and `local_dir` is set.
    """

    name: SubjectToken
    engine: Engine
    hf_repo: str | None = None
    #: A branch, tag or commit of `hf_repo`; default "main".
    hf_revision: str = "main"
    #: A directory holding the weights on every node that trains this model.
    local_dir: str | None = None
    description: str = ""
    #: From the model's config.json; without it jobs get no memory estimate.
    architecture: ModelArchitecture | None = None


class ModelRecord(msgspec.Struct, kw_only=True):
    name: str
    engine: Engine
    hf_repo: str | None
    hf_revision: str
    local_dir: str | None
    description: str
    created_at: dt.datetime
    architecture: ModelArchitecture | None = None


class ModelListRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class ModelList(msgspec.Struct, kw_only=True):
    models: list[ModelRecord]


# --- jobs ------------------------------------------------------------------


class TrainerParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The trainer's settings. Every field has a default suited to a small adapter."""

    #: LoRA rank r; default 16.
    rank: Annotated[int, Meta(ge=1, le=1024)] = 16
    #: LoRA alpha (the update is scaled by alpha / rank); default 32.
    alpha: Annotated[float, Meta(gt=0)] = 32.0
    #: Dropout on the LoRA input; default 0.05.
    dropout: Annotated[float, Meta(ge=0, lt=1)] = 0.05
    #: Module names to adapt (q_proj, v_proj, ...) or "all-linear"; default "all-linear".
    target_modules: list[Annotated[str, Meta(min_length=1)]] | Literal["all-linear"] = "all-linear"
    #: Peak learning rate; default 2e-4.
    learning_rate: Annotated[float, Meta(gt=0, le=1)] = 2e-4
    lr_scheduler: Literal["linear", "cosine", "constant"] = "cosine"
    #: Optimizer steps of linear warm-up; default 0.
    warmup_steps: Annotated[int, Meta(ge=0)] = 0
    #: Passes over the training data; default 1. Ignored when max_steps is set.
    epochs: Annotated[int, Meta(ge=1, le=1000)] = 1
    #: Optimizer steps to run; 0 means as many as `epochs` take; default 0.
    max_steps: Annotated[int, Meta(ge=0)] = 0
    #: Records per micro-batch; default 4.
    batch_size: Annotated[int, Meta(ge=1, le=4096)] = 4
    #: Micro-batches per optimizer step; default 1.
    gradient_accumulation: Annotated[int, Meta(ge=1, le=4096)] = 1
    #: Tokens per record; longer records are cut (and counted). Default 1024.
    max_seq_len: Annotated[int, Meta(ge=8, le=1_048_576)] = 1024
    gradient_checkpointing: bool = False
    #: "auto" is bf16 on cards that have it, fp16 on other cards, fp32 on the CPU.
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    seed: int = 42
    #: Share of the records held out for the per-epoch eval loss; default 0.1.
    eval_fraction: Annotated[float, Meta(ge=0, lt=1)] = 0.1
    #: A checkpoint (the adapter, optimizer, LR scheduler and RNG states and the
    #: position in the data plan) every this many optimizer steps; default 0:
    #: by time only. Never after the last step: the adapter is the result then.
    checkpoint_every_steps: Annotated[int, Meta(ge=0)] = 0
    #: A checkpoint when this many seconds have passed since the last one (or
    #: since training began); 0: no time trigger; both 0: no checkpoints.
    #: Default 600: a lost node costs at most 10 minutes of training, and a
    #: LoRA's state (only the trainable weights, no base) takes seconds to
    #: write, off the training loop, so a few per hour cost well under 1%.
    checkpoint_every_s: Annotated[float, Meta(ge=0)] = 600.0


class JobSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`lorafleet.api.jobs.submit`: what to train.

    The data is either inline (`data`, NDJSON text, when it fits one message)
    or named (`dataset`, an object in the `lorafleet_datasets` bucket, as
    `nats object put lorafleet_datasets FILE` leaves it). Records are
    `{"q": ..., "a": ...}` or `{"messages": [{"role": ..., "content": ...}]}`.
    """

    model: SubjectToken
    #: The card memory the job may use. None: the memory estimate plus its
    #: margin (the model must have its architecture in the catalog).
    gpu_memory_mib: PositiveMiB | None = None
    name: str = ""
    #: The node to train on; none lets the scheduler place the job.
    node: SubjectToken | None = None
    data: str | None = None
    dataset: str | None = None
    params: TrainerParams = msgspec.field(default_factory=TrainerParams)
    #: Queue the job even when gpu_memory_mib is below the memory estimate.
    ignore_estimate: bool = False
    #: How many times the job may be sent to a node. With attempts left, a
    #: job whose node is lost, whose agent restarts without it, or whose
    #: trainer dies for a cause not its own goes back to the queue and
    #: resumes from its newest checkpoint. 1: such a job fails.
    max_attempts: Annotated[int, Meta(ge=1, le=100)] = 1
    #: Start from another job's newest checkpoint (else its adapter): continue
    #: training, on this job's data.
    resume_from: str | None = None


class EstimateLine(msgspec.Struct, kw_only=True):
    """One part of a memory estimate: weights, adapter, gradients, ..."""

    name: str
    bytes: int
    mib: float
    #: How the line is counted.
    note: str = ""


class MemoryEstimate(msgspec.Struct, kw_only=True):
    """The estimated peak card memory of a training job, line by line."""

    lines: list[EstimateLine]
    total_bytes: int
    total_mib: int
    #: The total plus the margin: what a submit without gpu_memory_mib asks for.
    recommended_mib: int
    margin_fraction: float
    #: The token length of a micro-batch's rows the activations assume.
    seq_len: int
    #: The dtype the estimate assumes for the weights and activations.
    dtype: str


class JobEstimateRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`lorafleet.api.jobs.estimate`: the estimate for a job, nothing queued."""

    model: SubjectToken
    params: TrainerParams = msgspec.field(default_factory=TrainerParams)
    #: Checked against the estimate when given.
    gpu_memory_mib: PositiveMiB | None = None


class JobEstimate(msgspec.Struct, kw_only=True):
    model: str
    #: None when the catalog has no architecture for the model (see `reason`).
    estimate: MemoryEstimate | None = None
    #: Why there is no estimate, or why gpu_memory_mib is too small; else "".
    reason: str = ""
    #: gpu_memory_mib is at least the estimate (True when none was given).
    fits: bool = True


class CheckpointRef(msgspec.Struct, kw_only=True):
    """A stored artifact a job starts from: a checkpoint, or an adapter."""

    #: The job that stored it.
    job_id: str
    kind: ArtifactKind
    #: The optimizer step it holds (0 for an adapter: training starts afresh).
    step: int = 0
    #: The attempt of `job_id` that wrote it.
    attempt: int = 1
    #: The object in `lorafleet_artifacts`.
    object: str
    size: int
    sha256: Sha256Hex


class JobRecord(msgspec.Struct, kw_only=True):
    """A job as the recorder holds it."""

    id: str
    name: str
    model: str
    engine: Engine
    node: str | None
    gpu_memory_mib: int
    #: The object in `lorafleet_datasets` that holds the data.
    dataset: str
    dataset_sha256: str
    records: int
    params: TrainerParams
    state: JobState
    message: str
    step: int
    steps: int
    loss: float | None
    eval_loss: float | None
    peak_mib: int
    #: How many times the job was sent to a node.
    attempt: int
    #: The artifact kinds the job must store before it is done.
    artifacts_expected: list[ArtifactKind]
    artifacts_stored: list[ArtifactKind]
    created_at: dt.datetime
    updated_at: dt.datetime
    started_at: dt.datetime | None = None
    finished_at: dt.datetime | None = None
    #: See JobSpec.max_attempts.
    max_attempts: int = 1
    #: The node the submitter named (`node` is where the job is placed now).
    requested_node: str | None = None
    #: The job whose checkpoint or adapter this one started from (JobSpec.resume_from).
    resume_from: str | None = None
    #: The newest checkpoint stored for this job, if any.
    checkpoint: CheckpointRef | None = None
    #: Its stored PEFT adapter, once stored (a job with resume_from this one
    #: starts from it when it has no checkpoint).
    adapter: CheckpointRef | None = None
    #: Grows by one with every committed change of the job: of two records
    #: of one job, the one with the higher version is newer. `updated_at`
    #: cannot say that: a writer stamps its time before it waits for the
    #: row, so a change can commit after another yet carry an earlier time.
    #: 0 from a recorder older than this field.
    version: int = 0


class JobGetRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    id: str


class JobListRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`lorafleet.api.jobs.list`: newest first unless `oldest_first`."""

    state: JobState | None = None
    #: Any of these states (combined with `state` when both are given).
    states: list[JobState] = msgspec.field(default_factory=list)
    node: str | None = None
    model: str | None = None
    limit: Annotated[int, Meta(ge=1, le=1000)] = 50
    oldest_first: bool = False


class JobList(msgspec.Struct, kw_only=True):
    jobs: list[JobRecord]


class JobCancelRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    id: str
    reason: str = ""


class JobResumeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`lorafleet.api.jobs.resume`: queue a failed or cancelled job again, from
    its newest checkpoint, as a new attempt."""

    id: str
    reason: str = ""
    #: More attempts for it (its max_attempts grows so that this many are left).
    attempts: Annotated[int, Meta(ge=1, le=100)] = 1


class LossPoint(msgspec.Struct, kw_only=True):
    step: int
    loss: float
    learning_rate: float | None = None
    tokens_per_s: float | None = None
    peak_mib: int | None = None
    #: The attempt that wrote it.
    attempt: int = 1


class EvalPoint(msgspec.Struct, kw_only=True):
    step: int
    eval_loss: float
    #: The attempt that wrote it.
    attempt: int = 1


class JobCurveRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    id: str


class JobCurve(msgspec.Struct, kw_only=True):
    """`lorafleet.api.jobs.curve`: the loss curve and the job's state changes."""

    id: str
    points: list[LossPoint]
    events: list[JobEventRecord]
    #: The eval loss at each evaluated step, by step.
    evals: list[EvalPoint] = msgspec.field(default_factory=list)


class JobEventRecord(msgspec.Struct, kw_only=True):
    """One state change of a job, as stored."""

    time: dt.datetime
    from_state: JobState | None
    to_state: JobState
    message: str


class JobEvent(msgspec.Struct, kw_only=True):
    """Published on `lorafleet.events.jobs.<id>` after each commit that changed the job."""

    #: "state" when the state changed, "progress" otherwise.
    kind: Literal["state", "progress"]
    job: JobRecord
    #: The trainer's latest throughput and time-to-go, when the change came
    #: from its status reports (they are not kept on the job).
    tokens_per_s: float | None = None
    eta_s: float | None = None


# --- internal: scheduler / artifact-store -> recorder ----------------------


class TransitionRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`lorafleet.store.jobs.transition`: compare-and-set of a job's state.

    Applied only when the job is in `from_state` (and, when `node` is given
    for a job that has one, on that node). A final state never changes.
    """

    id: str
    from_state: JobState
    to_state: JobState
    message: str = ""
    #: Set the job's node (placement of a job submitted without one).
    node: str | None = None


class TransitionReply(msgspec.Struct, kw_only=True):
    """`applied` is false when the job had moved on; `job` is as it is now."""

    applied: bool
    job: JobRecord


class ArtifactStoredRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`lorafleet.store.jobs.artifact`: an artifact of a job is stored and verified."""

    id: str
    kind: ArtifactKind
    size: int
    sha256: Sha256Hex
    #: For a checkpoint: the step it holds, the attempt that wrote it, its object.
    step: int | None = None
    attempt: int | None = None
    object: str | None = None


# --- scheduler <-> agent ---------------------------------------------------


class StartRequest(msgspec.Struct, kw_only=True):
    """`lorafleet.node.<node>.start`: train this job."""

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


class StartReply(msgspec.Struct, kw_only=True):
    accepted: bool
    #: Why not, when not accepted.
    reason: str = ""
    #: The job the node is busy with, when busy.
    running_job: str | None = None


class NodeCancelRequest(msgspec.Struct, kw_only=True):
    """`lorafleet.node.<node>.cancel`."""

    job_id: str
    reason: str = ""


class NodeCancelReply(msgspec.Struct, kw_only=True):
    #: True when the job was running there and is now stopped.
    stopped: bool


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


class NodeInfo(msgspec.Struct, kw_only=True):
    heartbeat: Heartbeat
    alive: bool


class NodeListRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class NodeList(msgspec.Struct, kw_only=True):
    nodes: list[NodeInfo]


# --- agent -> recorder: status --------------------------------------------


class StatusReport(msgspec.Struct, kw_only=True):
    """Published on the `lorafleet.status.<node>.<job>` stream by the agent.

    `seq` counts from 1 per job and attempt; the recorder applies each
    report once and ignores older ones for the job's scalar fields.
    """

    job_id: str
    node: str
    attempt: int
    seq: Annotated[int, Meta(ge=1)]
    time: dt.datetime
    #: A state change, when this report is one.
    state: JobState | None = None
    message: str = ""
    step: int | None = None
    steps: int | None = None
    loss: float | None = None
    learning_rate: float | None = None
    tokens_per_s: float | None = None
    eta_s: float | None = None
    eval_loss: float | None = None
    peak_mib: int | None = None
    #: With state `failed`: the cause is not the job's own (the trainer was
    #: killed, the card failed), so a job with attempts left is queued again.
    retryable: bool = False


# --- the trainer's JSON-lines protocol (trainer stdout -> agent) -----------


class TrainerState(msgspec.Struct, kw_only=True, tag="state", tag_field="event"):
    """A state change inside the trainer: "preparing" (loading), "running", "saving"."""

    state: Literal["preparing", "running", "saving"]
    message: str = ""


class TrainerStep(msgspec.Struct, kw_only=True, tag="step", tag_field="event"):
    """One optimizer step."""

    step: int
    steps: int
    loss: float
    learning_rate: float
    tokens_per_s: float
    eta_s: float
    #: torch's peak reserved MiB on a card; peak RSS MiB on the CPU.
    peak_mib: int
    epoch: int = 0


class TrainerEval(msgspec.Struct, kw_only=True, tag="eval", tag_field="event"):
    step: int
    epoch: int
    eval_loss: float


class TrainerLog(msgspec.Struct, kw_only=True, tag="log", tag_field="event"):
    """Something a person should read (records cut at max length, ...)."""

    message: str
    level: Literal["info", "warning"] = "info"


class TrainerDone(msgspec.Struct, kw_only=True, tag="done", tag_field="event"):
    adapter_dir: str
    #: The directory the base weights were read from (the GGUF conversion needs it).
    base_dir: str
    summary: dict[str, Any] = msgspec.field(default_factory=dict)


class TrainerError(msgspec.Struct, kw_only=True, tag="error", tag_field="event"):
    message: str


class TrainerCheckpoint(msgspec.Struct, kw_only=True, tag="checkpoint", tag_field="event"):
    """A complete checkpoint is on disk (written to a temporary name, then
    renamed): the state after optimizer step `step`."""

    step: int
    #: The checkpoint directory.
    path: str
    epoch: int = 0


class TrainerLengths(msgspec.Struct, kw_only=True, tag="lengths", tag_field="event"):
    """The token lengths of the records tokenized before the weights load (all
    of them without max_steps; with it, those its steps read)."""

    records_tokenized: int
    records_cut: int
    records_skipped: int
    min: int
    p50: int
    p95: int
    max: int
    mean: int


TrainerLine = (
    TrainerState
    | TrainerStep
    | TrainerEval
    | TrainerLog
    | TrainerDone
    | TrainerError
    | TrainerLengths
    | TrainerCheckpoint
)


# --- agent -> artifact-store: chunks ---------------------------------------


class ArtifactChunkHeader(msgspec.Struct, kw_only=True):
    """JSON in the `Lorafleet-Chunk` header of each chunk on
    `lorafleet.artifacts.<node>.<job>.<kind>`; the body is the chunk's bytes.

    The last chunk also carries the artifact's chunk count, size and sha256.
    """

    job_id: str
    node: str
    kind: ArtifactKind
    attempt: int
    seq: Annotated[int, Meta(ge=0)]
    last: bool = False
    count: int | None = None
    size: int | None = None
    sha256: Sha256Hex | None = None
    #: For a checkpoint: the optimizer step it holds.
    step: int | None = None


class ArtifactRecord(msgspec.Struct, kw_only=True):
    job_id: str
    kind: ArtifactKind
    node: str
    #: The object in `lorafleet_artifacts`: `<job>/<kind>`.
    object: str
    size: int
    sha256: str
    base_model: str
    stored_at: dt.datetime


class ArtifactListRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    job_id: str


class ArtifactList(msgspec.Struct, kw_only=True):
    artifacts: list[ArtifactRecord]


class ArtifactGetRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    job_id: str
    kind: ArtifactKind


#: Every message with a published schema: file name -> Struct (or union).
PUBLISHED: dict[str, object] = {
    "error": ErrorReply,
    "model-spec": ModelSpec,
    "model-record": ModelRecord,
    "model-list-request": ModelListRequest,
    "model-list": ModelList,
    "trainer-params": TrainerParams,
    "job-spec": JobSpec,
    "job-record": JobRecord,
    "job-get-request": JobGetRequest,
    "job-list-request": JobListRequest,
    "job-list": JobList,
    "job-cancel-request": JobCancelRequest,
    "job-resume-request": JobResumeRequest,
    "checkpoint-ref": CheckpointRef,
    "job-curve-request": JobCurveRequest,
    "job-curve": JobCurve,
    "job-estimate-request": JobEstimateRequest,
    "job-estimate": JobEstimate,
    "job-event": JobEvent,
    "transition-request": TransitionRequest,
    "transition-reply": TransitionReply,
    "artifact-stored-request": ArtifactStoredRequest,
    "start-request": StartRequest,
    "start-reply": StartReply,
    "node-cancel-request": NodeCancelRequest,
    "node-cancel-reply": NodeCancelReply,
    "heartbeat": Heartbeat,
    "node-list-request": NodeListRequest,
    "node-list": NodeList,
    "status-report": StatusReport,
    "trainer-line": TrainerLine,
    "artifact-chunk-header": ArtifactChunkHeader,
    "artifact-record": ArtifactRecord,
    "artifact-list-request": ArtifactListRequest,
    "artifact-list": ArtifactList,
    "artifact-get-request": ArtifactGetRequest,
}
