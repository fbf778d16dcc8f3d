"""Jobs as clients see them: what to train, its estimate, its record, the
requests about it, its loss curve and the events published as it changes."""

from __future__ import annotations

import datetime as dt
import enum
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from lorafleet_schemas.messages.artifacts import ArtifactKind
from lorafleet_schemas.messages.catalog import Engine, ServingPolicy
from lorafleet_schemas.messages.fields import ListLimit, PositiveMiB, Sha256Hex, SubjectToken
from lorafleet_schemas.messages.serving import ServingRecord


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
    #: Recompute decoder layers' activations in the backward pass instead of
    #: keeping them: true every layer, false none; "auto" (the default) the
    #: least (none, every k-th layer, every layer) whose memory estimate fits
    #: the job's gpu_memory_mib, none without one (lorafleet_trainer.memory).
    gradient_checkpointing: bool | Literal["auto"] = "auto"
    #: "auto" is bf16 on cards that have it, fp16 on other cards, fp32 on the CPU.
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    seed: int = 42
    #: Share of the records held out for the per-epoch eval loss; default 0.1.
    #: Unused when the job has an evaluation set (JobSpec.eval_data).
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
    #: "auto" (the default): on a node whose engines serve users, training
    #: pauses between steps while they are busy and goes on once they have
    #: been idle a moment (the node's thresholds: AgentConfig.yield_*);
    #: "off": it trains on whatever the engines' load.
    yield_to_serving: Literal["auto", "off"] = "auto"
    #: What the records train: "supervised" (conversations, cross-entropy on
    #: the answers) or "dpo" (preference pairs, DPO's sigmoid loss against the
    #: model with the adapter disabled); lorafleet_trainer.records has both.
    method: Literal["supervised", "dpo"] = "supervised"
    #: DPO's beta: how far the adapter may move from the reference for a
    #: preference (higher: less); default 0.1. Unused by "supervised".
    beta: Annotated[float, Meta(gt=0, le=100)] = 0.1


class JobSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`lorafleet.api.jobs.submit`: what to train.

    The data is either inline (`data`, NDJSON text, when it fits one message)
    or named (`dataset`, an object in the `lorafleet_datasets` bucket, as
    `nats object put lorafleet_datasets FILE` leaves it). Records are
    `{"q": ..., "a": ...}` or `{"messages": [{"role": ..., "content": ...}]}`.
    An evaluation set, when given, is the same: inline (`eval_data`) or
    named (`eval_dataset`), at most one of the two, the same records.
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
    #: The records the eval loss is computed on (inline NDJSON). With an
    #: evaluation set the trainer trains on every training record and
    #: params.eval_fraction is unused; without one it holds that share out.
    eval_data: str | None = None
    #: The evaluation set by name, an object in `lorafleet_datasets` (as `dataset`).
    eval_dataset: str | None = None
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
    #: Load the adapter into the node's running engines that serve the
    #: model once the job is done. None (the default): yes when such an
    #: engine runs on the node; False: never; True: yes, and a node with no
    #: such engine records why.
    serve: bool | None = None
    #: Served across the fleet once done ("all", or {"replicas": N}); None:
    #: the model's default (ModelSpec.serving), else only where it trained.
    #: `serve: false` serves it nowhere, whatever this says.
    serving: ServingPolicy | None = None


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
    #: See JobSpec.serve.
    serve: bool | None = None
    #: See JobSpec.serving (as given; the model's default is not copied in).
    serving: ServingPolicy | None = None
    #: The tokens the trainer trained on (padding not counted) over every
    #: attempt: a run resumed from a checkpoint starts from the count it
    #: holds. From the done summary; None until then, and for a trainer
    #: that does not count them.
    tokens_seen: int | None = None
    #: The object in `lorafleet_datasets` that holds the evaluation set
    #: (JobSpec.eval_data / eval_dataset); None: the trainer holds out
    #: params.eval_fraction of the training data instead.
    eval_dataset: str | None = None
    eval_dataset_sha256: str | None = None
    #: The evaluation set's records (0 without one).
    eval_records: int = 0
    #: A DPO job's newest step numbers (rewards_chosen, rewards_rejected,
    #: margin, accuracy: lorafleet_schemas.messages.TrainerStep) and newest
    #: held-out ones (eval_margin, eval_accuracy, ...); None otherwise.
    preference: dict[str, float] | None = None
    eval_preference: dict[str, float] | None = None


class JobGetRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    id: str


class JobListRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`lorafleet.api.jobs.list`: newest first unless `oldest_first`."""

    state: JobState | None = None
    #: Any of these states (combined with `state` when both are given).
    states: list[JobState] = msgspec.field(default_factory=list)
    node: str | None = None
    model: str | None = None
    limit: ListLimit = 50
    oldest_first: bool = False
    #: These jobs only (empty: any): many jobs in one request (the gateway's
    #: model list asks for its caller's jobs at once).
    ids: list[str] = msgspec.field(default_factory=list)
    #: The jobs after this one in the list's order (the last id of the page
    #: before): the next page. A page a NATS message cannot hold is refused.
    after: str | None = None
    #: Only jobs a serving policy places (their own `serving`, else their
    #: catalog model's), never one with `serve: false`: the scheduler's
    #: replica rounds page through these.
    placed: bool = False


class JobList(msgspec.Struct, kw_only=True):
    jobs: list[JobRecord]


class JobCancelRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    id: str
    reason: str = ""


class JobDeleteRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`lorafleet.api.jobs.delete`: forget a final job (its record, events and
    curves); retention then removes what only it needed (its artifacts, data
    no other job or file names). Refused while it is not final, while an
    engine serves its adapter, or while a job not final starts from it."""

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
    #: A DPO job's step numbers (JobRecord.preference); None otherwise.
    preference: dict[str, float] | None = None


class EvalPoint(msgspec.Struct, kw_only=True):
    step: int
    eval_loss: float
    #: The attempt that wrote it.
    attempt: int = 1
    #: A DPO job's held-out numbers (JobRecord.eval_preference); None otherwise.
    preference: dict[str, float] | None = None


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

    #: "state" when the state changed, "serving" when one of its serving
    #: records did (`serving` holds it), "progress" otherwise.
    kind: Literal["state", "progress", "serving"]
    job: JobRecord
    #: The trainer's latest throughput and time-to-go, when the change came
    #: from its status reports (they are not kept on the job).
    tokens_per_s: float | None = None
    eta_s: float | None = None
    serving: ServingRecord | None = None
