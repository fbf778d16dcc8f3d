"""The agent's status reports to the recorder, one stream per node and job."""

from __future__ import annotations

import datetime as dt
from typing import Annotated

import msgspec
from msgspec import Meta

from lorafleet_schemas.messages.jobs import JobState

#: How a job's message begins while its trainer yields to the node's
#: engines (`watch` and `top` show it so).
YIELDING_TO_SERVING = "yielding to serving"


class StatusReport(msgspec.Struct, kw_only=True):
    """Published on the `lorafleet.status.<node>.<job>` stream by the agent.

    `seq` counts from 1 per job and attempt; the recorder applies each
    report once and ignores older ones for the job's scalar fields.
    """

    job_id: str
    node: str
    attempt: int
    seq: Annotated[int, Meta(ge=1)]
    time: dt.datetime
    #: A state change, when this report is one.
    state: JobState | None = None
    message: str = ""
    step: int | None = None
    steps: int | None = None
    loss: float | None = None
    learning_rate: float | None = None
    tokens_per_s: float | None = None
    eta_s: float | None = None
    eval_loss: float | None = None
    peak_mib: int | None = None
    #: A DPO job's step numbers (TrainerStep's rewards_chosen, rewards_rejected,
    #: margin, accuracy), with the step's report; None otherwise.
    preference: dict[str, float] | None = None
    #: A DPO job's held-out numbers (TrainerEval's eval_*), with the eval's report.
    eval_preference: dict[str, float] | None = None
    #: The attempt's trained tokens (the trainer's done summary), with the
    #: report that follows training; becomes JobRecord.tokens_seen.
    tokens_seen: int | None = None
    #: With state `failed`: the cause is not the job's own (the trainer was
    #: killed, the card failed), so a job with attempts left is queued again.
    retryable: bool = False
