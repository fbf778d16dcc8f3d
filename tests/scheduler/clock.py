"""A hand-driven monotonic clock for the scheduler's pieces (they take `clock`)."""

from __future__ import annotations


class Clock:
    """Call it for the time; set `now` to move it."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
