"""The recorder's live gauges: jobs and serving records by state, as one
query each before each scrape found them.

`Recorder.start` adds a `JobCounts` to `metrics.LIVE` with its refresher
(one `GROUP BY` per table: store.job_counts, servings.state_counts) and
removes it at stop.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from lorafleet.metrics import JOBS, QUEUE_DEPTH, QUEUE_OLDEST_AGE, SERVINGS, Sample
from lorafleet_schemas.messages import JobState, ServingState


@dataclass
class JobCounts:
    """Jobs by state as the recorder's last query found them (None: never asked)."""

    by_state: dict[str, int] | None = None
    #: Seconds the oldest queued job has waited, when the query ran.
    oldest_queued_s: float = 0.0
    #: Serving records by state (None: never asked).
    servings: dict[str, int] | None = None

    def set(
        self,
        by_state: Mapping[str, int],
        oldest_queued_s: float,
        servings: Mapping[str, int] | None = None,
    ) -> None:
        self.by_state = {s.value: int(by_state.get(s.value, 0)) for s in JobState}
        self.oldest_queued_s = max(0.0, oldest_queued_s)
        if servings is not None:
            self.servings = {s.value: int(servings.get(s.value, 0)) for s in ServingState}

    def samples(self) -> Iterator[Sample]:
        if self.by_state is None:
            return
        for state, n in self.by_state.items():
            yield JOBS, (state,), float(n)
        yield QUEUE_DEPTH, (), float(self.by_state[JobState.QUEUED.value])
        yield QUEUE_OLDEST_AGE, (), self.oldest_queued_s
        for state, n in (self.servings or {}).items():
            yield SERVINGS, (state,), float(n)
