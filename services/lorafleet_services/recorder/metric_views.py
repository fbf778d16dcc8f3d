"""The recorder's live gauges: jobs by state, as one query before each scrape found them.

`Recorder.start` adds a `JobCounts` to `metrics.LIVE` with its refresher
(one `GROUP BY`, store.job_counts) and removes it at stop.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from lorafleet.metrics import JOBS, QUEUE_DEPTH, QUEUE_OLDEST_AGE, Sample
from lorafleet_schemas.messages import JobState


@dataclass
class JobCounts:
    """Jobs by state as the recorder's last query found them (None: never asked)."""

    by_state: dict[str, int] | None = None
    #: Seconds the oldest queued job has waited, when the query ran.
    oldest_queued_s: float = 0.0

    def set(self, by_state: Mapping[str, int], oldest_queued_s: float) -> None:
        self.by_state = {s.value: int(by_state.get(s.value, 0)) for s in JobState}
        self.oldest_queued_s = max(0.0, oldest_queued_s)

    def samples(self) -> Iterator[Sample]:
        if self.by_state is None:
            return
        for state, n in self.by_state.items():
            yield JOBS, (state,), float(n)
        yield QUEUE_DEPTH, (), float(self.by_state[JobState.QUEUED.value])
        yield QUEUE_OLDEST_AGE, (), self.oldest_queued_s
