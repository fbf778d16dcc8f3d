"""The fold of status reports into a job: pure, no database, no clock of its own.

`fold(job, reports, t)` takes a `jobs` row (a dict, rows.py) and a batch of
that job's reports and returns what they do to it (`Folded`); the store
writes it guarded by the row's version (job_writes.py). The rule, stated
here once (the why: recorder/DESIGN.md):

- a report from another node or attempt than the job's is refused, as is any
  report for a queued job, and one for a final job newer than the last it
  applied;
- each loss and eval point is stored once (ON CONFLICT DO NOTHING on job,
  step, attempt); `peak_mib` only grows;
- each scalar field (step, steps, loss, eval_loss, message, tokens_seen,
  state) takes the value of the highest-sequence report that carried it
  (`field_seqs`; `last_seq` the highest applied);
- a state change must be allowed by `lorafleet.states`: a report never makes
  `done` nor moves a job back (an older state is stale); `uploading` with
  every expected artifact stored goes on to `done`;
- a `failed` report with `retryable` requeues a job with attempts left
  (`states.loss_outcome`), else fails it with the report's message.

So neither order nor repetition changes the outcome. `effective(points,
starts)` is the curve across attempts: a later attempt's points supersede
an earlier one's from the step it started at.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from lorafleet.states import FINAL, REQUEUE_FROM, can_move, loss_outcome
from lorafleet_schemas.messages import EvalPoint, JobState, LossPoint, StatusReport
from lorafleet_services.recorder.rows import (
    Row,
    eval_point_row,
    job_record,
    loss_point_row,
)

#: Scalar job fields a status report sets, each from its newest report.
SCALARS = (
    "step", "steps", "loss", "eval_loss", "message", "tokens_seen",
    "preference", "eval_preference",
)  # fmt: skip


@dataclass
class Move:
    """A state change made by a report (or by artifacts completing)."""

    from_state: JobState
    to_state: JobState
    message: str


@dataclass
class Folded:
    """What a batch of reports does to one job (the result of `fold`)."""

    values: dict[str, Any] = field(default_factory=dict)
    points: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    moves: list[Move] = field(default_factory=list)
    refused: list[tuple[StatusReport, str]] = field(default_factory=list)
    #: Reports whose state change was older than the job's state (dropped).
    stale: list[StatusReport] = field(default_factory=list)


def all_stored(expected: Sequence[str], stored: Sequence[str]) -> bool:
    return set(expected) <= set(stored)


def stored_message(stored: Sequence[str]) -> str:
    """The message of a job made done by its last artifact."""
    return f"every artifact is stored and verified: {', '.join(stored)}"


def completion(state: JobState, expected: Sequence[str], stored: Sequence[str]) -> Move | None:
    """The move to `done` a job in `state` makes now that `stored` are its
    stored artifacts: only from the state `done` is reached from
    (`uploading`), and only once every `expected` kind is stored; else None.
    A status report (`fold`) and a stored artifact (job_writes.py) both ask."""
    if not can_move(state, JobState.DONE) or not all_stored(expected, stored):
        return None
    return Move(state, JobState.DONE, stored_message(stored))


def why_report_refused(job: Row, report: StatusReport) -> str | None:
    """Why `report` does not apply to `job` at all, or None when it applies."""
    if job["node"] is None:
        return f"job {job['id']} is not placed on any node; node {report.node} cannot report it"
    if report.node != job["node"]:
        return f"job {job['id']} runs on node {job['node']}, not {report.node}"
    if job["state"] == JobState.QUEUED.value:
        return (
            f"job {job['id']} is queued again (attempt {job['attempt']} ended); "
            f"node {report.node} cannot report it"
        )
    if report.attempt != job["attempt"]:
        return f"job {job['id']} is on attempt {job['attempt']}, the report is of {report.attempt}"
    if JobState(job["state"]) in FINAL and report.seq > job["last_seq"]:
        return f"job {job['id']} is {job['state']}, which is final"
    return None


def fold(job: Row, reports: Iterable[StatusReport], t: dt.datetime) -> Folded:
    """Apply `reports` to a job row in memory (see the module docstring); `t`
    stamps `updated_at` (and `finished_at`) when a column changes."""
    out = Folded()
    state = JobState(job["state"])
    last_seq: int = job["last_seq"]
    seqs: dict[str, int] = dict(job["field_seqs"])
    scalars: dict[str, Any] = {f: job[f] for f in SCALARS}
    peak: int = job["peak_mib"]
    for r in sorted(reports, key=lambda r: r.seq):
        why = why_report_refused({**job, "state": state.value, "last_seq": last_seq}, r)
        if why is not None:
            out.refused.append((r, why))
            continue
        if r.peak_mib is not None:
            peak = max(peak, r.peak_mib)
        if r.step is not None and r.loss is not None:
            out.points.append(loss_point_row(job["id"], r))
        if r.step is not None and r.eval_loss is not None:
            out.evals.append(eval_point_row(job["id"], r))
        _take_scalars(r, scalars, seqs)
        if r.state is not None and r.seq > seqs.get("state", 0):
            state = _fold_state(job, scalars, seqs, state, r, out)
        last_seq = max(last_seq, r.seq)
    new = {**scalars, "state": state.value, "last_seq": last_seq, "field_seqs": seqs}
    out.values = {**out.values, **_changed(job, {**new, "peak_mib": peak}, t)}
    return out


def _fold_state(
    job: Row,
    scalars: dict[str, Any],
    seqs: dict[str, int],
    state: JobState,
    r: StatusReport,
    out: Folded,
) -> JobState:
    """The job's state after `r`, the newest report to carry a state so far
    (its moves, refusal or staleness noted in `out`)."""
    if r.state is JobState.FAILED and r.retryable and state in REQUEUE_FROM:
        move = _retryable_failure(job, scalars, state, r)
        out.moves.append(move)
        seqs["state"] = r.seq
        scalars["message"] = move.message
        if move.to_state is JobState.QUEUED:
            # The attempt is over: its later reports are refused (queued).
            out.values["node"] = job["requested_node"]
        return move.to_state
    if r.state is JobState.DONE:
        out.refused.append((r, "a status report cannot make a job done"))
        return state
    if r.state is not None and r.state is not state and can_move(state, r.state):
        out.moves.append(Move(state, r.state, r.message))
        seqs["state"] = r.seq
        done = completion(r.state, job["artifacts_expected"], job["artifacts_stored"])
        if done is not None:
            out.moves.append(done)
            scalars["message"] = done.message
            return done.to_state
        return r.state
    if r.state is not state:
        out.stale.append(r)
    return state


def _retryable_failure(
    job: Row, scalars: Mapping[str, Any], state: JobState, r: StatusReport
) -> Move:
    """A failure not the job's own: requeued with attempts left, else failed."""
    now_job = job_record({**job, **scalars, "state": state.value})
    cause = f"the job failed on node {r.node} for a cause not its own ({r.message})"
    to, said = loss_outcome(now_job, cause, r.message)
    return Move(state, to, said)


def _take_scalars(r: StatusReport, scalars: dict[str, Any], seqs: dict[str, int]) -> None:
    """Each scalar `r` carries, if `r` is newer than the report that set it (`field_seqs`)."""
    for name in SCALARS:
        value = getattr(r, name)
        if value is None or (name == "message" and not value):
            continue
        if r.seq > seqs.get(name, 0):
            scalars[name] = value
            seqs[name] = r.seq


def _changed(job: Row, new: dict[str, Any], t: dt.datetime) -> dict[str, Any]:
    """The columns of `new` that differ from `job`'s, stamped with `t` when any do."""
    values = {k: v for k, v in new.items() if job[k] != v}
    if values:
        values["updated_at"] = t
        if JobState(new["state"]) in FINAL and JobState(job["state"]) not in FINAL:
            values["finished_at"] = t
    return values


P = TypeVar("P", LossPoint, EvalPoint)


def effective(points: Sequence[P], starts: Mapping[int, int]) -> list[P]:
    """The points a curve shows, by step: a point of attempt a is superseded
    when a later attempt b started at or before it (its step > b's start
    step, the checkpoint b resumed from). starts: attempt -> start step; an
    attempt missing from it (none recorded) starts before its first point."""
    first: dict[int, int] = {}
    for p in points:
        first[p.attempt] = min(first.get(p.attempt, p.step), p.step)
    begun = {a: starts.get(a, first.get(a, 1) - 1) for a in {*starts, *first}}
    kept = [
        p for p in points if not any(b > p.attempt and p.step > start for b, start in begun.items())
    ]
    return sorted(kept, key=lambda p: (p.step, p.attempt))
