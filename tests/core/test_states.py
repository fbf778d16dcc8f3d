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
