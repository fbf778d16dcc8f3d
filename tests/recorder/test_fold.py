"""The fold of status reports into a job (recorder/fold.py), with no database."""

from __future__ import annotations

import datetime as dt
import itertools
from typing import Any

import pytest

from lorafleet_schemas.messages import EvalPoint, JobState, LossPoint, StatusReport
from lorafleet_services.recorder.fold import (
    Folded,
    Move,
    completion,
    effective,
    fold,
    why_report_refused,
)

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
T1 = T0 + dt.timedelta(minutes=5)


def job_row(**columns: Any) -> dict[str, Any]:
    """A running `jobs` row on node n1, attempt 1, nothing reported yet."""
    row: dict[str, Any] = {
        "id": "j1",
        "name": "",
        "model": "tiny",
        "engine": "vllm",
        "node": "n1",
        "gpu_memory_mib": 1000,
        "dataset": "sha256/" + "0" * 64,
        "dataset_sha256": "0" * 64,
        "records": 3,
        "params": {},
        "state": JobState.RUNNING.value,
        "message": "",
        "step": 0,
        "steps": 0,
        "loss": None,
        "eval_loss": None,
        "tokens_seen": None,
        "preference": None,
        "eval_preference": None,
        "peak_mib": 0,
        "attempt": 1,
        "last_seq": 0,
        "field_seqs": {},
        "artifacts_expected": ["peft"],
        "artifacts_stored": [],
        "version": 3,
        "created_at": T0,
        "updated_at": T0,
        "started_at": T0,
        "finished_at": None,
        "max_attempts": 1,
        "requested_node": None,
        "resume_from": None,
        "checkpoint": None,
        "artifact_refs": None,
        "attempt_starts": {"1": 0},
    }
    return {**row, **columns}


def rep(seq: int, node: str = "n1", attempt: int = 1, **fields: Any) -> StatusReport:
    return StatusReport(
        job_id="j1",
        node=node,
        attempt=attempt,
        seq=seq,
        time=T0 + dt.timedelta(seconds=seq),
        **fields,
    )


def applied(row: dict[str, Any], folded: Folded) -> dict[str, Any]:
    """`row` as the store writes it after `folded`."""
    return {**row, **folded.values}


RUN = [
    rep(1, state=JobState.RUNNING, message="training"),
    rep(2, step=1, steps=3, loss=2.5, peak_mib=400),
    rep(3, step=2, steps=3, loss=2.0, peak_mib=300),
    rep(4, step=2, eval_loss=1.9),
    rep(5, step=3, steps=3, loss=1.5, peak_mib=350),
    rep(6, state=JobState.CONVERTING, message="to gguf"),
]


def test_the_newest_report_of_each_field_wins_in_any_order() -> None:
    want = fold(job_row(), RUN, T1)
    assert want.values["step"] == 3 and want.values["loss"] == 1.5
    assert want.values["eval_loss"] == 1.9 and want.values["peak_mib"] == 400
    assert want.values["state"] == "converting" and want.values["message"] == "to gguf"
    assert want.values["last_seq"] == 6 and want.values["updated_at"] == T1
    for order in itertools.permutations(RUN):
        assert fold(job_row(), order, T1).values == want.values


def test_a_batch_split_and_in_any_order_ends_where_one_batch_does() -> None:
    whole = applied(job_row(), fold(job_row(), RUN, T1))
    row = job_row()
    for r in reversed(RUN):
        row = applied(row, fold(row, [r], T1))
    assert {k: row[k] for k in whole} == whole


def test_a_batch_folded_again_changes_nothing() -> None:
    row = applied(job_row(), fold(job_row(), RUN, T1))
    again = fold(row, RUN, T1)
    assert again.values == {} and again.moves == [] and again.refused == []
    assert len(again.points) == 3, "the store inserts points once (ON CONFLICT DO NOTHING)"


def test_a_late_older_report_fills_in_what_no_newer_one_carried() -> None:
    row = applied(job_row(), fold(job_row(), [rep(5, step=4, loss=1.0)], T1))
    late = fold(row, [rep(2, step=1, steps=9, loss=3.0, eval_loss=2.0)], T1)
    assert late.values["steps"] == 9 and late.values["eval_loss"] == 2.0
    assert "step" not in late.values and "loss" not in late.values
    assert "last_seq" not in late.values, "last_seq stays the highest applied"


def test_peak_only_grows() -> None:
    folded = fold(job_row(peak_mib=800), [rep(1, peak_mib=300), rep(2, peak_mib=500)], T1)
    assert "peak_mib" not in folded.values


def test_points_carry_the_report_attempt() -> None:
    folded = fold(job_row(), RUN, T1)
    assert [p["step"] for p in folded.points] == [1, 2, 3]
    assert folded.evals == [
        {"job_id": "j1", "step": 2, "eval_loss": 1.9, "attempt": 1, "preference": None}
    ]
    assert folded.points[0] == {
        "job_id": "j1",
        "step": 1,
        "loss": 2.5,
        "learning_rate": None,
        "tokens_per_s": None,
        "peak_mib": 400,
        "attempt": 1,
        "preference": None,
    }


@pytest.mark.parametrize(
    ("row", "report", "why"),
    [
        (job_row(node=None), rep(1), "is not placed on any node"),
        (job_row(), rep(1, node="n2"), "runs on node n1, not n2"),
        (job_row(state="queued"), rep(1), "is queued again (attempt 1 ended)"),
        (job_row(), rep(1, attempt=2), "is on attempt 1, the report is of 2"),
        (job_row(state="cancelled", last_seq=4), rep(5), "is cancelled, which is final"),
    ],
)
def test_reports_that_are_not_the_job_s_are_refused(
    row: dict[str, Any], report: StatusReport, why: str
) -> None:
    assert why in (why_report_refused(row, report) or "")
    folded = fold(row, [report], T1)
    assert [r for r, _ in folded.refused] == [report] and folded.values == {}


def test_a_final_job_takes_what_it_had_applied_already() -> None:
    assert why_report_refused(job_row(state="cancelled", last_seq=4), rep(4)) is None


def test_no_report_makes_a_job_done_or_moves_it_back() -> None:
    folded = fold(job_row(), [rep(1, state=JobState.DONE)], T1)
    assert folded.refused == [
        (rep(1, state=JobState.DONE), "a status report cannot make a job done")
    ]
    older = rep(2, state=JobState.PREPARING)
    folded = fold(job_row(state="converting"), [older], T1)
    assert folded.stale == [older] and folded.moves == []
    assert folded.values == {"last_seq": 2, "updated_at": T1}, "applied, its state dropped"


def test_uploading_with_every_artifact_stored_goes_on_to_done() -> None:
    row = job_row(artifacts_stored=["peft"])
    uploading = rep(1, state=JobState.UPLOADING, message="delivering", tokens_seen=48)
    folded = fold(row, [uploading], T1)
    said = "every artifact is stored and verified: peft"
    assert folded.moves == [
        Move(JobState.RUNNING, JobState.UPLOADING, "delivering"),
        Move(JobState.UPLOADING, JobState.DONE, said),
    ]
    assert folded.values["state"] == "done" and folded.values["message"] == said
    assert folded.values["finished_at"] == T1
    assert folded.values["tokens_seen"] == 48, "the trainer's total rides on the uploading report"


@pytest.mark.parametrize("state", list(JobState))
def test_only_uploading_with_every_artifact_stored_completes(state: JobState) -> None:
    """The one rule both paths to `done` ask (a report here, a stored artifact
    in job_writes.py): every expected kind stored, and the job uploading."""
    both = ["peft", "gguf"]
    done = completion(state, both, ["gguf", "peft"])
    if state is JobState.UPLOADING:
        said = "every artifact is stored and verified: gguf, peft"
        assert done == Move(JobState.UPLOADING, JobState.DONE, said)
    else:
        assert done is None
    assert completion(state, both, ["peft"]) is None, "gguf is not stored yet"


def test_a_retryable_failure_requeues_while_attempts_are_left() -> None:
    failed = rep(3, state=JobState.FAILED, retryable=True, message="trainer killed")
    row = job_row(max_attempts=2, requested_node="n1", step=7)
    folded = fold(row, [failed, rep(4, step=8, loss=1.0)], T1)
    [move] = folded.moves
    assert move.to_state is JobState.QUEUED
    assert "for a cause not its own (trainer killed) at step 7; attempt 2 of 2" in move.message
    assert folded.values["state"] == "queued" and folded.values["node"] == "n1"
    assert [r.seq for r, _ in folded.refused] == [4], "the attempt ended: later reports refused"


def test_a_retryable_failure_with_no_attempts_left_fails_the_job() -> None:
    failed = rep(3, state=JobState.FAILED, retryable=True, message="trainer killed")
    folded = fold(job_row(), [failed], T1)
    assert folded.moves == [Move(JobState.RUNNING, JobState.FAILED, "trainer killed")]
    assert folded.values["finished_at"] == T1 and "node" not in folded.values


def test_a_later_attempt_supersedes_from_the_step_it_started_at() -> None:
    points = [LossPoint(step=s, loss=1.0, attempt=1) for s in (1, 2, 3)] + [
        LossPoint(step=s, loss=0.5, attempt=2) for s in (3, 4)
    ]
    kept = effective(points, {1: 0, 2: 2})
    assert [(p.step, p.attempt) for p in kept] == [(1, 1), (2, 1), (3, 2), (4, 2)]
    evals = [EvalPoint(step=2, eval_loss=1.0, attempt=1), EvalPoint(step=4, eval_loss=0.5)]
    assert effective(evals, {}) == evals


def test_a_dpo_jobs_numbers_go_to_the_job_and_its_points() -> None:
    """The step's numbers and the eval's, each from its own report: the
    job keeps the newest of each, each curve point its own."""
    step = {"margin": 0.5, "accuracy": 0.75}
    held = {"eval_margin": 0.4, "eval_accuracy": 1.0}
    folded = fold(job_row(), [
        rep(1, step=1, loss=0.6, preference={"margin": 0.1, "accuracy": 0.5}),
        rep(2, step=2, loss=0.5, preference=step),
        rep(3, step=2, eval_loss=0.55, eval_preference=held),
    ], T1)  # fmt: skip
    assert folded.values["preference"] == step and folded.values["eval_preference"] == held
    assert [p["preference"] for p in folded.points] == [{"margin": 0.1, "accuracy": 0.5}, step]
    assert [e["preference"] for e in folded.evals] == [held]
