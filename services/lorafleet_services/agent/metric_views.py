"""The agent's live gauges: the progress of the jobs it runs, as their status reports carry it.

The reporter keeps each report's fields in `RUNNING_JOBS`; `Agent.start`
sets its linger (`metrics_linger_s`) and adds it to `metrics.LIVE`, and
removes it at stop.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from lorafleet.metrics import (
    JOB_ETA,
    JOB_EVAL_LOSS,
    JOB_LOSS,
    JOB_PEAK,
    JOB_STEP,
    JOB_STEPS,
    JOB_TOKENS,
    LiveGauge,
    Sample,
)
from lorafleet_trainer.memory import MIB

_JOB_FIELDS: dict[str, tuple[LiveGauge, float]] = {
    "step": (JOB_STEP, 1.0),
    "steps": (JOB_STEPS, 1.0),
    "loss": (JOB_LOSS, 1.0),
    "eval_loss": (JOB_EVAL_LOSS, 1.0),
    "tokens_per_s": (JOB_TOKENS, 1.0),
    "peak_mib": (JOB_PEAK, float(MIB)),
    "eta_s": (JOB_ETA, 1.0),
}


@dataclass
class _JobValues:
    values: dict[str, float] = field(default_factory=dict)
    #: Monotonic seconds when the job ended here (None: running).
    ended_at: float | None = None


class RunningJobs:
    """The progress of the jobs an agent runs now, as its status reports carry it.

    linger_s: seconds a finished job's series stay, so that the last scrape
    sees its final values; default 60. clock: monotonic seconds.
    """

    def __init__(self, linger_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self.linger_s = linger_s
        self.clock = clock
        self._jobs: dict[tuple[str, str], _JobValues] = {}

    def report(self, node: str, job_id: str, fields: Mapping[str, Any]) -> None:
        """Keep each progress field of a status report that carries one."""
        job = self._jobs.setdefault((node, job_id), _JobValues())
        for name, value in fields.items():
            if value is not None and name in _JOB_FIELDS:
                job.values[name] = float(value)

    def ended(self, node: str, job_id: str) -> None:
        job = self._jobs.get((node, job_id))
        if job is not None and job.ended_at is None:
            job.ended_at = self.clock()
        self._prune()  # also where nothing scrapes: the table stays bounded

    def __len__(self) -> int:
        """Jobs held: running, or finished and lingering."""
        return len(self._jobs)

    def _prune(self) -> None:
        now = self.clock()
        for key, job in list(self._jobs.items()):
            if job.ended_at is not None and now - job.ended_at >= self.linger_s:
                del self._jobs[key]

    def samples(self) -> Iterator[Sample]:
        self._prune()
        for key, job in list(self._jobs.items()):
            for name, value in job.values.items():
                gauge, scale = _JOB_FIELDS[name]
                yield gauge, key, value * scale


#: The jobs this agent process runs.
RUNNING_JOBS = RunningJobs()
