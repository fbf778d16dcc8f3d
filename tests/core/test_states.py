from __future__ import annotations

import pytest

from lorafleet.states import ACTIVE, ALLOWED, FINAL, IllegalTransitionError, can_move, check_move
from lorafleet_schemas.messages import JobState as S


def test_final_states_never_change() -> None:
    for final in FINAL:
        assert ALLOWED[final] == frozenset()
        for target in S:
            with pytest.raises(IllegalTransitionError, match="final"):
                check_move(final, target)


def test_every_active_state_can_fail_or_be_cancelled() -> None:
    for state in ACTIVE:
        assert can_move(state, S.FAILED)
        assert can_move(state, S.CANCELLED)


def test_queued_only_leaves_for_starting() -> None:
    assert ALLOWED[S.QUEUED] == {S.STARTING, S.FAILED, S.CANCELLED}


def test_done_only_from_uploading() -> None:
    assert [s for s in S if can_move(s, S.DONE)] == [S.UPLOADING]


def test_forward_skips_allowed_backward_never() -> None:
    assert can_move(S.RUNNING, S.UPLOADING)  # no GGUF to make
    assert not can_move(S.RUNNING, S.PREPARING)
    assert not can_move(S.UPLOADING, S.QUEUED)
    with pytest.raises(IllegalTransitionError, match="from running it can go to"):
        check_move(S.RUNNING, S.STARTING)


def test_loss_outcome_requeues_only_an_on_node_job_with_attempts_left() -> None:
    from lorafleet.states import can_requeue, can_resume, loss_outcome
    from lorafleet_schemas.messages import ArtifactKind, CheckpointRef
    from tests.records import job_record

    job = job_record(state=S.RUNNING, attempt=1, max_attempts=3, step=57)
    assert loss_outcome(job, "node n1 was lost", "failed!") == (
        S.QUEUED,
        "node n1 was lost at step 57; attempt 2 of 3 starts again from step 0 "
        "(no checkpoint was stored)",
    )
    cp = CheckpointRef(
        job_id=job.id, kind=ArtifactKind.CHECKPOINT, step=50, object="x", size=1, sha256="0" * 64
    )
    with_cp = job_record(state=S.UPLOADING, attempt=2, max_attempts=3, step=57, checkpoint=cp)
    assert loss_outcome(with_cp, "lost", "failed!")[1].endswith(
        "attempt 3 of 3 resumes from the checkpoint at step 50"
    )
    last = job_record(state=S.RUNNING, attempt=3, max_attempts=3)
    assert loss_outcome(last, "lost", "failed!") == (S.FAILED, "failed!")
    # max_attempts 1, the default: fails exactly as before.
    assert loss_outcome(job_record(state=S.RUNNING), "lost", "the seed's") == (
        S.FAILED,
        "the seed's",
    )
    assert not can_requeue(S.QUEUED, 1, 3) and not can_requeue(S.DONE, 1, 3)
    assert all(can_requeue(s, 1, 2) for s in (S.STARTING, S.PREPARING, S.RUNNING, S.CONVERTING))
    assert [s for s in S if can_resume(s)] == [S.FAILED, S.CANCELLED]
    # Neither edge is one a report may take.
    assert not any(can_move(s, S.QUEUED) for s in S)
