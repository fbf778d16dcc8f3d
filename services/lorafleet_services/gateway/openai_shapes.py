"""OpenAI's wire shapes the gateway speaks, as msgspec Structs.

The `openai` Python SDK's types (the version pinned in pyproject's dev
extra) are the reference: field names, which are required, and the
literals. Requests are decoded leniently (OpenAI adds fields; an unknown
one is ignored, as OpenAI does), except where lorafleet would silently
do something else than asked (see `JobCreate`). Timestamps are Unix
seconds, as OpenAI's are.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from lorafleet_schemas.messages import ServingPolicy

#: OpenAI's `"auto"` or a value.
Auto = Literal["auto"]


class ErrorDetail(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(msgspec.Struct, kw_only=True):
    """`{"error": {...}}`: every error the gateway answers."""

    error: ErrorDetail


class Page(msgspec.Struct, kw_only=True):
    """A cursor page (`SyncCursorPage`): the SDK asks for the next one with
    `after=<last id>` while `has_more`."""

    data: list[Any]
    has_more: bool = False
    object: str = "list"
    first_id: str | None = None
    last_id: str | None = None


class FileObject(msgspec.Struct, kw_only=True):
    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    object: str = "file"
    status: str = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class FileDeleted(msgspec.Struct, kw_only=True):
    id: str
    deleted: bool
    object: str = "file"


class Hyperparameters(msgspec.Struct, kw_only=True):
    batch_size: Auto | Annotated[int, Meta(ge=1, le=4096)] | None = None
    learning_rate_multiplier: Auto | Annotated[float, Meta(gt=0, le=1000)] | None = None
    n_epochs: Auto | Annotated[int, Meta(ge=1, le=1000)] | None = None


class Supervised(msgspec.Struct, kw_only=True):
    hyperparameters: Hyperparameters | None = None


class DpoHyperparameters(Hyperparameters, kw_only=True):
    #: DPO's beta; "auto" is 0.1.
    beta: Auto | Annotated[float, Meta(gt=0, le=100)] | None = None


class Dpo(msgspec.Struct, kw_only=True):
    hyperparameters: DpoHyperparameters | None = None


class Method(msgspec.Struct, kw_only=True):
    type: str = "supervised"
    supervised: Supervised | None = None
    dpo: Dpo | None = None


class LorafleetOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`extra_body={"lorafleet": {...}}` of a job create: what OpenAI has no
    word for. Unknown fields are refused (a typo would train otherwise)."""

    #: LoRA rank; default the trainer's (16).
    rank: Annotated[int, Meta(ge=1, le=1024)] | None = None
    #: The node to train on; default: the scheduler places the job.
    node: str | None = None
    #: The card memory (MiB) the job may use; default the memory estimate.
    gpu_memory_mib: Annotated[int, Meta(ge=1)] | None = None
    #: How many times the job may be sent to a node; default 1.
    max_attempts: Annotated[int, Meta(ge=1, le=100)] | None = None
    #: Optimizer steps to run (0: as many as the epochs take); default 0.
    max_steps: Annotated[int, Meta(ge=0)] | None = None
    #: A checkpoint every this many steps (what `pause` resumes from); default 0.
    checkpoint_every_steps: Annotated[int, Meta(ge=0)] | None = None
    #: Load the adapter once done (JobSpec.serve); false: `succeeded` with
    #: the model served nowhere.
    serve: bool | None = None
    #: Where it is served once done: "all" or {"replicas": N}; default the
    #: catalog model's (JobSpec.serving).
    serving: ServingPolicy | None = None


class JobCreate(msgspec.Struct, kw_only=True):
    """`POST /v1/fine_tuning/jobs`."""

    model: str
    training_file: str
    validation_file: str | None = None
    suffix: Annotated[str, Meta(max_length=64)] | None = None
    seed: int | None = None
    metadata: dict[str, str] | None = None
    method: Method | None = None
    #: The older top-level form of `method.supervised.hyperparameters`.
    hyperparameters: Hyperparameters | None = None
    integrations: list[Any] | None = None
    lorafleet: LorafleetOptions | None = None


class JobError(msgspec.Struct, kw_only=True):
    code: str
    message: str
    param: str | None = None


class FineTuningJob(msgspec.Struct, kw_only=True):
    id: str
    created_at: int
    error: JobError | None
    fine_tuned_model: str | None
    finished_at: int | None
    hyperparameters: Hyperparameters
    model: str
    organization_id: str
    result_files: list[str]
    seed: int
    status: str
    trained_tokens: int | None
    training_file: str
    validation_file: str | None
    estimated_finish: int | None
    metadata: dict[str, str] | None
    method: Method
    object: str = "fine_tuning.job"
    integrations: list[Any] | None = None
    #: lorafleet's own view of the job (its state, node, step, attempt).
    lorafleet: dict[str, Any] | None = None


class JobEvent(msgspec.Struct, kw_only=True):
    id: str
    created_at: int
    level: str
    message: str
    type: str
    data: dict[str, Any] | None = None
    object: str = "fine_tuning.job.event"


class CheckpointMetrics(msgspec.Struct, kw_only=True, omit_defaults=True):
    step: float | None = None
    train_loss: float | None = None
    valid_loss: float | None = None


class Checkpoint(msgspec.Struct, kw_only=True):
    id: str
    created_at: int
    fine_tuned_model_checkpoint: str
    fine_tuning_job_id: str
    metrics: CheckpointMetrics
    step_number: int
    object: str = "fine_tuning.job.checkpoint"


class Model(msgspec.Struct, kw_only=True):
    id: str
    created: int
    owned_by: str
    object: str = "model"
    #: The engines' base URLs that serve it now (lorafleet's addition).
    served_by: list[str] = msgspec.field(default_factory=list)
