"""lorafleet's jobs in OpenAI's shapes: plain tests of the pure mapping."""

from __future__ import annotations

import datetime as dt

import msgspec
import pytest

from lorafleet_schemas.messages import (
    Engine,
    EvalPoint,
    JobCurve,
    JobEventRecord,
    JobRecord,
    JobState,
    LossPoint,
    Replicas,
    TrainerParams,
)
from lorafleet_services.gateway import job_mapping as jm
from lorafleet_services.gateway.http_errors import GatewayHttpError
from lorafleet_services.gateway.openai_shapes import Hyperparameters, JobCreate
from lorafleet_services.gateway.state import FileRecord, JobFields

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def record(state: JobState, **changes: object) -> JobRecord:
    job = JobRecord(
        id="j1", name="", model="tiny", engine=Engine.VLLM, node="n1", gpu_memory_mib=1,
        dataset="d", dataset_sha256="0" * 64, records=4, params=TrainerParams(), state=state,
        message="", step=0, steps=10, loss=None, eval_loss=None, peak_mib=0, attempt=1,
        artifacts_expected=[], artifacts_stored=[], created_at=T0, updated_at=T0,
    )  # fmt: skip
    return msgspec.structs.replace(job, **changes)


def fields(**changes: object) -> JobFields:
    base = JobFields(
        job_id="j1", model="tiny", training_file="file-1", seed=42,
        hyperparameters=Hyperparameters(), created_at=T0,
    )  # fmt: skip
    return msgspec.structs.replace(base, **changes)


@pytest.mark.parametrize(
    ("state", "paused", "status"),
    [
        (JobState.QUEUED, False, "queued"),
        (JobState.STARTING, False, "running"),
        (JobState.PREPARING, False, "running"),
        (JobState.RUNNING, False, "running"),
        (JobState.CONVERTING, False, "running"),
        (JobState.UPLOADING, False, "running"),
        (JobState.DONE, False, "succeeded"),
        (JobState.FAILED, False, "failed"),
        (JobState.CANCELLED, False, "cancelled"),
        (JobState.CANCELLED, True, "paused"),
    ],
)
def test_every_lorafleet_state_has_its_openai_status(
    state: JobState, paused: bool, status: str
) -> None:
    assert jm.status_of(record(state), fields(paused=paused)) == status


def test_a_succeeded_job_names_its_model_and_a_failed_one_its_error() -> None:
    done = jm.to_openai(record(JobState.DONE), fields(suffix="sums"), "alice", T0)
    assert done.fine_tuned_model == "ft:tiny:sums:j1" and done.error is None
    assert jm.to_openai(record(JobState.DONE), fields(), "a", T0).fine_tuned_model == "ft:tiny::j1"
    failed = jm.to_openai(record(JobState.FAILED, message="out of memory"), fields(), "a", T0)
    assert failed.fine_tuned_model is None and failed.trained_tokens is None
    counted = jm.to_openai(record(JobState.DONE, tokens_seen=96), fields(), "a", T0)
    assert counted.trained_tokens == 96
    assert failed.error is not None and failed.error.message == "out of memory"


def test_estimated_finish_follows_the_pace_so_far() -> None:
    running = record(JobState.RUNNING, started_at=T0, step=5, steps=10)
    now = T0 + dt.timedelta(seconds=60)
    assert jm.estimated_finish(running, now) == int(T0.timestamp()) + 120
    assert jm.estimated_finish(record(JobState.DONE, started_at=T0, step=10), now) is None


def test_hyperparameters_map_onto_the_trainers_and_auto_keeps_its_default() -> None:
    create = JobCreate(
        model="tiny", training_file="f", seed=3,
        hyperparameters=Hyperparameters(n_epochs=3, batch_size="auto",
                                        learning_rate_multiplier=0.5),
    )  # fmt: skip
    params = jm.trainer_params(create, jm.requested_hyperparameters(create))
    assert (params.epochs, params.batch_size, params.seed) == (3, TrainerParams().batch_size, 3)
    assert params.learning_rate == pytest.approx(TrainerParams().learning_rate / 2)
    too_high = JobCreate(
        model="tiny", training_file="f",
        hyperparameters=Hyperparameters(learning_rate_multiplier=10000),
    )  # fmt: skip
    with pytest.raises(GatewayHttpError) as caught:
        jm.trainer_params(too_high, jm.requested_hyperparameters(too_high))
    assert caught.value.status == 400


def test_the_extension_sets_where_the_model_is_served() -> None:
    file = FileRecord(
        id="file-1", filename="d.jsonl", bytes=1, created_at=T0, purpose="fine-tune",
        dataset="d", records=4,
    )  # fmt: skip

    def spec(body: bytes) -> tuple[object, object]:
        create = msgspec.json.decode(body, type=JobCreate)
        job = jm.job_spec(create, file, TrainerParams())
        return job.serve, job.serving

    plain = b'{"model": "tiny", "training_file": "file-1"}'
    assert spec(plain) == (None, None)  # the catalog model's policy, served where it trained
    two = b'{"model": "tiny", "training_file": "file-1", "lorafleet": {"serving": {"replicas": 2}}}'
    assert spec(two) == (None, Replicas(replicas=2))
    everywhere = b'{"model": "tiny", "training_file": "file-1", "lorafleet": {"serving": "all"}}'
    assert spec(everywhere) == (None, "all")
    nowhere = b'{"model": "tiny", "training_file": "file-1", "lorafleet": {"serve": false}}'
    assert spec(nowhere) == (False, None)
    with pytest.raises(msgspec.ValidationError, match="serving"):
        spec(b'{"model": "tiny", "training_file": "f", "lorafleet": {"serving": "some"}}')


def test_pages_follow_the_cursor() -> None:
    items = [f"x{i}" for i in range(5)]
    first = jm.paginate(items, str, None, 2)
    assert (first.data, first.has_more, first.last_id) == (["x0", "x1"], True, "x1")
    last = jm.paginate(items, str, "x3", 2)
    assert (last.data, last.has_more) == (["x4"], False)
    with pytest.raises(GatewayHttpError):
        jm.paginate(items, str, "nope", 2)


def test_events_come_newest_first_with_losses_as_metrics() -> None:
    job = record(JobState.DONE, started_at=T0, finished_at=T0 + dt.timedelta(seconds=10), steps=2)
    curve = JobCurve(
        id="j1",
        points=[LossPoint(step=1, loss=2.0), LossPoint(step=2, loss=1.0)],
        evals=[EvalPoint(step=2, eval_loss=1.5)],
        events=[
            JobEventRecord(time=T0, from_state=None, to_state=JobState.RUNNING, message=""),
            JobEventRecord(time=T0 + dt.timedelta(seconds=11), from_state=JobState.RUNNING,
                           to_state=JobState.DONE, message="all stored"),
        ],
    )  # fmt: skip
    events = jm.events(job, curve, T0)
    assert [e.type for e in events] == ["message", "metrics", "metrics", "message"]
    assert events[0].message == "running -> done: all stored"
    assert events[1].data == {
        "step": 2, "train_loss": 1.0, "total_steps": 2, "attempt": 1, "valid_loss": 1.5
    }  # fmt: skip
    assert len({e.id for e in events}) == 4
