"""The job state machine, as data. Every service asks this module; none re-states it.

    queued -> starting -> preparing -> running -> converting -> uploading -> done
    any non-final state -> failed | cancelled
    starting..uploading -> queued          (requeue: the control plane, a loss not the job's own)
    failed | cancelled -> queued           (resume: api.jobs.resume, by hand)

A job may skip forward along the happy path (no GGUF to make: running ->
uploading), never back, except by the two edges to `queued`, which are not
in `ALLOWED` because no status report may take them: requeue
(`can_requeue`, `loss_outcome`: a loss with attempts left; or a move off a
drained node, `moved_message`, which needs none left and uses none) and resume
(`can_resume`: from the newest checkpoint, as a new attempt). On either
edge `node` goes back to the node the submitter named, and the next
dispatch counts the next attempt. Who takes which move: docs/architecture.md.
"""

from __future__ import annotations

from lorafleet_schemas.messages import JobRecord, JobState

#: The happy path, in order.
PATH: tuple[JobState, ...] = (
    JobState.QUEUED,
    JobState.STARTING,
    JobState.PREPARING,
    JobState.RUNNING,
    JobState.CONVERTING,
    JobState.UPLOADING,
    JobState.DONE,
)

FINAL: frozenset[JobState] = frozenset({JobState.DONE, JobState.FAILED, JobState.CANCELLED})

#: States in which a node holds the job.
ON_NODE: frozenset[JobState] = frozenset(
    {
        JobState.STARTING,
        JobState.PREPARING,
        JobState.RUNNING,
        JobState.CONVERTING,
        JobState.UPLOADING,
    }
)

#: On a node with its training ahead or under way: what a drain's
#: move_training moves. A job converting or uploading has trained; moved, it
#: would train again, so it finishes where it is.
MOVABLE: frozenset[JobState] = frozenset({JobState.STARTING, JobState.PREPARING, JobState.RUNNING})

#: Not final: queued or on a node.
ACTIVE: frozenset[JobState] = ON_NODE | {JobState.QUEUED}


def _allowed() -> dict[JobState, frozenset[JobState]]:
    out: dict[JobState, frozenset[JobState]] = {}
    for i, state in enumerate(PATH):
        if state in FINAL:
            out[state] = frozenset()
            continue
        forward = set(PATH[i + 1 :])
        # `done` is reached only from `uploading`: every artifact stored.
        if state is not JobState.UPLOADING:
            forward.discard(JobState.DONE)
        # Only the scheduler moves a job off the queue, and only to `starting`.
        if state is JobState.QUEUED:
            forward = {JobState.STARTING}
        out[state] = frozenset(forward | {JobState.FAILED, JobState.CANCELLED})
    out[JobState.FAILED] = frozenset()
    out[JobState.CANCELLED] = frozenset()
    return out


#: from-state -> the states a job may move to from it.
ALLOWED: dict[JobState, frozenset[JobState]] = _allowed()


class IllegalTransitionError(ValueError):
    """A move the state machine does not allow."""


def can_move(from_state: JobState, to_state: JobState) -> bool:
    return to_state in ALLOWED[from_state]


def check_move(from_state: JobState, to_state: JobState) -> None:
    if not can_move(from_state, to_state):
        if from_state in FINAL:
            raise IllegalTransitionError(
                f"the job is {from_state.value}, which is final: nothing changes it"
            )
        raise IllegalTransitionError(
            f"a job cannot go from {from_state.value} to {to_state.value}; "
            f"from {from_state.value} it can go to "
            + ", ".join(sorted(s.value for s in ALLOWED[from_state]))
        )


def is_final(state: JobState) -> bool:
    return state in FINAL


#: States a requeue leaves (the job was on a node), and those a resume leaves.
REQUEUE_FROM: frozenset[JobState] = ON_NODE
RESUME_FROM: frozenset[JobState] = frozenset({JobState.FAILED, JobState.CANCELLED})


def can_requeue(from_state: JobState, attempt: int, max_attempts: int) -> bool:
    """The control plane may put a job in `from_state` back on the queue: it
    is on a node (so on its first attempt at least) with attempts left."""
    return from_state in REQUEUE_FROM and max(attempt, 1) < max_attempts


def can_resume(from_state: JobState) -> bool:
    return from_state in RESUME_FROM


def resumes_from(job: JobRecord) -> str:
    """How the job's next attempt starts, for a message."""
    if job.checkpoint is not None:
        return f"resumes from the checkpoint at step {job.checkpoint.step}"
    if job.resume_from is not None:
        return f"starts again from job {job.resume_from}'s weights"
    return "starts again from step 0 (no checkpoint was stored)"


def moved_message(job: JobRecord, cause: str) -> str:
    """The message of a job the operator moved off its node (a drain's
    `move_training`): a requeue that uses up none of its attempts (the
    recorder grows max_attempts by one, counted here)."""
    return (
        f"{cause} at step {job.step}; attempt {job.attempt + 1} of {job.max_attempts + 1} "
        f"{resumes_from(job)} on another node (the move uses none of its attempts)"
    )


def loss_outcome(job: JobRecord, cause: str, failed_message: str) -> tuple[JobState, str]:
    """What a loss that is not the job's own does to `job`: queued again with
    a message saying why (when it has attempts left), else failed with
    `failed_message` (the seed's message: max_attempts 1 behaves as before).

    cause: what happened, e.g. "node n1 stopped heartbeating".
    """
    if not can_requeue(job.state, job.attempt, job.max_attempts):
        return JobState.FAILED, failed_message
    return JobState.QUEUED, (
        f"{cause} at step {job.step}; attempt {job.attempt + 1} of {job.max_attempts} "
        f"{resumes_from(job)}"
    )
