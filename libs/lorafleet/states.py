"""The job state machine, as data. Every service asks this module; none re-states it.

    queued -> starting -> preparing -> running -> converting -> uploading -> done
    any non-final state -> failed | cancelled

A job may skip forward along the happy path (an agent that has no GGUF to make
goes from running straight to uploading), never back.
"""

from __future__ import annotations

from lorafleet_schemas.messages import JobState

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
