"""lorafleet's jobs in OpenAI's shapes, and back: pure code, no bus, no HTTP.

Ids (`ftjob-<job id>`, a fine-tuned model `ft:<base>:<suffix>:<job id>`),
the status of each lorafleet state, the methods taken (`supervised`, `dpo`)
and the hyperparameters (`n_epochs`, `batch_size`, `learning_rate_multiplier`
of the trainer's 2e-4, DPO's `beta`; "auto" keeps the trainer's default) are
written once here; docs/fine-tune-and-serve.md has the tables.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import msgspec

from lorafleet.states import ON_NODE
from lorafleet_schemas.messages import (
    ArtifactKind,
    ArtifactRecord,
    CheckpointRef,
    JobCurve,
    JobRecord,
    JobSpec,
    JobState,
    LossPoint,
    TrainerParams,
)
from lorafleet_services.gateway.http_errors import GatewayHttpError, bad_request
from lorafleet_services.gateway.openai_shapes import (
    Checkpoint,
    CheckpointMetrics,
    Dpo,
    DpoHyperparameters,
    FineTuningJob,
    Hyperparameters,
    JobCreate,
    JobError,
    JobEvent,
    Method,
    Page,
    Supervised,
)
from lorafleet_services.gateway.state import FileRecord, JobFields

T = TypeVar("T")

JOB_ID_PREFIX = "ftjob-"
#: Page sizes OpenAI allows, and its default.
MAX_PAGE = 100
DEFAULT_PAGE = 20

_STATUS = {JobState.QUEUED: "queued", JobState.DONE: "succeeded", JobState.FAILED: "failed"}
_DEFAULTS = TrainerParams()
#: The `method.type`s lorafleet trains (OpenAI's third, "reinforcement", it does not).
METHODS = ("supervised", "dpo")


def openai_job_id(job_id: str) -> str:
    return JOB_ID_PREFIX + job_id


def lorafleet_job_id(openai_id: str) -> str:
    """The lorafleet id inside `ftjob-<id>` ("" when it is not one)."""
    return openai_id.removeprefix(JOB_ID_PREFIX) if openai_id.startswith(JOB_ID_PREFIX) else ""


def fine_tuned_model_name(base: str, suffix: str | None, job_id: str) -> str:
    return f"ft:{base}:{suffix or ''}:{job_id}"


def fine_tuned_parts(model: str) -> tuple[str, str] | None:
    """(base, job id) of a `fine_tuned_model_name`, its inverse; None for another name."""
    parts = model.split(":")
    if len(parts) < 4 or parts[0] != "ft" or not parts[-1]:
        return None
    return parts[1], parts[-1]


def status_of(job: JobRecord, fields: JobFields) -> str:
    if job.state in ON_NODE:
        return "running"
    if job.state is JobState.CANCELLED:
        return "paused" if fields.paused else "cancelled"
    return _STATUS[job.state]


def method_type(create: JobCreate) -> str:
    """The job's method: "supervised" without one; a 400 naming those taken
    for any other."""
    kind = "supervised" if create.method is None else create.method.type
    if kind not in METHODS:
        raise bad_request(
            f"method.type {kind!r}: lorafleet trains LoRA adapters by "
            + " or ".join(f'"{m}"' for m in METHODS)
            + "; use one of those",
            "method.type",
        )
    return kind


def requested_hyperparameters(create: JobCreate) -> Hyperparameters:
    """`method.<type>.hyperparameters`, or the older top-level ones (not both);
    a DPO job's are DpoHyperparameters (with beta)."""
    kind = method_type(create)
    method = create.method
    method_hp: Hyperparameters | None = None
    if method is not None and kind == "dpo":
        method_hp = method.dpo.hyperparameters if method.dpo else None
    elif method is not None and method.supervised:
        method_hp = method.supervised.hyperparameters
    if method_hp is not None and create.hyperparameters is not None:
        raise bad_request(
            f"give the hyperparameters once: in method.{kind}.hyperparameters "
            "(the top-level hyperparameters are the older form of the same)",
            "hyperparameters",
        )
    found = method_hp or create.hyperparameters
    if kind == "dpo" and not isinstance(found, DpoHyperparameters):
        fields = {} if found is None else msgspec.structs.asdict(found)
        return DpoHyperparameters(**fields)
    return found or Hyperparameters()


def trainer_params(create: JobCreate, hp: Hyperparameters) -> TrainerParams:
    """The trainer's parameters for `create`; a value out of range is a 400."""
    values: dict[str, Any] = {}
    if isinstance(hp.n_epochs, int):
        values["epochs"] = hp.n_epochs
    if isinstance(hp.batch_size, int):
        values["batch_size"] = hp.batch_size
    if isinstance(hp.learning_rate_multiplier, float | int):
        values["learning_rate"] = _DEFAULTS.learning_rate * hp.learning_rate_multiplier
    if create.seed is not None:
        values["seed"] = create.seed
    if isinstance(hp, DpoHyperparameters):
        values["method"] = "dpo"
        if isinstance(hp.beta, float | int):
            values["beta"] = hp.beta
    ext = create.lorafleet
    if ext is not None:
        for name in ("rank", "max_steps", "checkpoint_every_steps"):
            if getattr(ext, name) is not None:
                values[name] = getattr(ext, name)
    try:
        return msgspec.convert(values, TrainerParams)
    except msgspec.ValidationError as e:
        raise bad_request(f"a hyperparameter is out of range: {e}", "hyperparameters") from None


def job_spec(
    create: JobCreate,
    file: FileRecord,
    params: TrainerParams,
    validation: FileRecord | None = None,
    parent: tuple[str, str] | None = None,
) -> JobSpec:
    """The job to submit: `file`'s data, `validation`'s as its evaluation set;
    `parent`: (base, job id) of the fine-tuned model it starts from."""
    ext = create.lorafleet
    return JobSpec(
        model=create.model if parent is None else parent[0],
        resume_from=None if parent is None else parent[1],
        name=create.suffix or "",
        dataset=file.dataset,
        eval_dataset=None if validation is None else validation.dataset,
        params=params,
        node=ext.node if ext else None,
        gpu_memory_mib=ext.gpu_memory_mib if ext else None,
        max_attempts=(ext.max_attempts or 1) if ext else 1,
        serve=ext.serve if ext else None,
        serving=ext.serving if ext else None,
    )


def job_fields(create: JobCreate, job: JobRecord, now: dt.datetime) -> JobFields:
    params = job.params
    parent = job.resume_from is not None
    return JobFields(
        job_id=job.id,
        model=job.model,
        parent_model=create.model if parent else None,
        method=params.method,
        beta=params.beta if params.method == "dpo" else None,
        training_file=create.training_file,
        validation_file=create.validation_file,
        suffix=create.suffix,
        seed=params.seed,
        metadata=create.metadata,
        hyperparameters=Hyperparameters(
            n_epochs=params.epochs,
            batch_size=params.batch_size,
            learning_rate_multiplier=params.learning_rate / _DEFAULTS.learning_rate,
        ),
        lorafleet=create.lorafleet,
        created_at=now,
    )


def unix(t: dt.datetime | None) -> int | None:
    return None if t is None else int(t.timestamp())


def estimated_finish(job: JobRecord, now: dt.datetime) -> int | None:
    """When a running job will end at its pace so far (None: not running, or no step yet)."""
    if job.state not in ON_NODE or not job.started_at or job.step <= 0 or job.steps <= 0:
        return None
    spent_s = (now - job.started_at).total_seconds()
    return int(job.started_at.timestamp() + spent_s * job.steps / job.step)


def method_of(fields: JobFields) -> Method:
    """The job's `method`, as OpenAI echoes it."""
    hp = fields.hyperparameters
    if fields.method == "dpo":
        dpo_hp = DpoHyperparameters(**msgspec.structs.asdict(hp), beta=fields.beta)
        return Method(type="dpo", dpo=Dpo(hyperparameters=dpo_hp))
    return Method(type="supervised", supervised=Supervised(hyperparameters=hp))


def to_openai(job: JobRecord, fields: JobFields, owner: str, now: dt.datetime) -> FineTuningJob:
    status = status_of(job, fields)
    method = method_of(fields)
    return FineTuningJob(
        id=openai_job_id(job.id),
        created_at=unix(job.created_at) or 0,
        error=JobError(code="training_failed", message=job.message) if status == "failed" else None,
        fine_tuned_model=(
            fine_tuned_model_name(fields.model, fields.suffix, job.id)
            if status == "succeeded"
            else None
        ),
        finished_at=unix(job.finished_at) if job.state not in ON_NODE else None,
        hyperparameters=fields.hyperparameters,
        model=fields.parent_model or fields.model,
        organization_id=owner,
        result_files=[],
        seed=fields.seed,
        status=status,
        trained_tokens=job.tokens_seen,
        training_file=fields.training_file,
        validation_file=fields.validation_file,
        estimated_finish=estimated_finish(job, now),
        metadata=fields.metadata,
        method=method,
        lorafleet={
            "state": job.state.value, "message": job.message, "node": job.node,
            "step": job.step, "steps": job.steps, "attempt": job.attempt,
            "loss": job.loss, "eval_loss": job.eval_loss,
            "base_model": fields.model,
            "parent_job": None if job.resume_from is None else openai_job_id(job.resume_from),
        },
    )  # fmt: skip


def paginate(items: Sequence[T], id_of: Callable[[T], str], after: str | None, limit: int) -> Page:
    """The page of `items` (newest first) after the one with id `after`."""
    if not 1 <= limit <= MAX_PAGE:
        raise bad_request(f"limit {limit}: give 1 to {MAX_PAGE}", "limit")
    start = 0
    if after:
        ids = [id_of(i) for i in items]
        if after not in ids:
            raise GatewayHttpError(
                400, f"after={after!r} is not in this list: pass the id of an item "
                "a previous page returned", param="after", code="invalid_cursor",
            )  # fmt: skip
        start = ids.index(after) + 1
    data = list(items[start : start + limit])
    return Page(
        data=data,
        has_more=start + limit < len(items),
        first_id=id_of(data[0]) if data else None,
        last_id=id_of(data[-1]) if data else None,
    )


def _level(to_state: JobState) -> str:
    return {JobState.FAILED: "error", JobState.CANCELLED: "warn"}.get(to_state, "info")


def _step_times(job: JobRecord, curve: JobCurve, now: dt.datetime) -> Callable[[int], dt.datetime]:
    """A loss point has no time of its own: it is placed between the run's
    start and its end (or now) by its step."""
    start = job.started_at or job.created_at
    end = job.finished_at or now
    steps = max(job.steps, max((p.step for p in curve.points), default=1), 1)
    return lambda step: start + (end - start) * (min(step, steps) / steps)


def metrics_message(point: LossPoint, steps: int) -> str:
    """A metrics event's words: the loss, and a DPO step's margin and accuracy."""
    text = f"Step {point.step}/{steps}: training loss={point.loss:.4f}"
    numbers = point.preference or {}
    if "margin" in numbers and "accuracy" in numbers:
        text += f", reward margin={numbers['margin']:.4f}, accuracy={numbers['accuracy']:.2f}"
    return text


def events(job: JobRecord, curve: JobCurve, now: dt.datetime) -> list[JobEvent]:
    """The job's events, newest first: its state changes (type "message") and
    one "metrics" event per logged step (train loss; valid loss where the
    trainer evaluated at that step; a DPO job's rewards, margin and accuracy,
    eval_* where it evaluated)."""
    time_of = _step_times(job, curve, now)
    valid = {(e.attempt, e.step): e for e in curve.evals}
    timeline: list[tuple[dt.datetime, int, JobEvent]] = []
    for n, change in enumerate(curve.events):
        text = f"{change.from_state or 'new'} -> {change.to_state}"
        message = f"{text}: {change.message}" if change.message else text
        timeline.append((change.time, n, JobEvent(
            id=f"ftevent-{job.id}-s{n}", created_at=unix(change.time) or 0,
            level=_level(change.to_state), message=message, type="message",
            data={"state": change.to_state.value},
        )))  # fmt: skip
    for n, point in enumerate(curve.points):
        data: dict[str, Any] = {"step": point.step, "train_loss": point.loss,
                                "total_steps": job.steps, "attempt": point.attempt}  # fmt: skip
        evaluated = valid.get((point.attempt, point.step))
        if evaluated is not None:
            data["valid_loss"] = evaluated.eval_loss
            data.update(evaluated.preference or {})
        if point.learning_rate is not None:
            data["learning_rate"] = point.learning_rate
        data.update(point.preference or {})
        at = time_of(point.step)
        timeline.append((at, len(curve.events) + n, JobEvent(
            id=f"ftevent-{job.id}-m{point.attempt}-{point.step}", created_at=unix(at) or 0,
            level="info", message=metrics_message(point, job.steps), type="metrics", data=data,
        )))  # fmt: skip
    timeline.sort(key=lambda t: (t[0], t[1]))
    return [event for _, _, event in reversed(timeline)]


def _metrics_at(curve: JobCurve, step: int) -> CheckpointMetrics:
    losses = [p for p in curve.points if p.step <= step]
    evals = [e for e in curve.evals if e.step <= step]
    return CheckpointMetrics(
        step=float(step),
        train_loss=losses[-1].loss if losses else None,
        valid_loss=evals[-1].eval_loss if evals else None,
    )


def checkpoints(
    job: JobRecord, fields: JobFields, curve: JobCurve, stored: list[ArtifactRecord]
) -> list[Checkpoint]:
    """Newest first: the final adapter (once stored) and the newest
    training checkpoint (lorafleet keeps one, each superseding the last)."""
    model = fine_tuned_model_name(fields.model, fields.suffix, job.id)
    stored_at = {a.kind: a.stored_at for a in stored}
    found: list[tuple[CheckpointRef, str, int]] = []
    if job.adapter is not None and ArtifactKind.PEFT in stored_at:
        found.append((job.adapter, model, job.steps or job.step))
    if job.checkpoint is not None and ArtifactKind.CHECKPOINT in stored_at:
        step = job.checkpoint.step
        found.append((job.checkpoint, f"{model}:ckpt-step-{step}", step))
    return [
        Checkpoint(
            id=f"ftckpt-{job.id}-{ref.kind.value}-{step}",
            created_at=unix(stored_at[ref.kind]) or 0,
            fine_tuned_model_checkpoint=name,
            fine_tuning_job_id=openai_job_id(job.id),
            metrics=_metrics_at(curve, step),
            step_number=step,
        )
        for ref, name, step in found
    ]
