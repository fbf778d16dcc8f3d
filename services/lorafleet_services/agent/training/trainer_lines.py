"""The trainer's stdout, read line by line (`TrainerLines`, the
`on_line` of its ManagedProcess).

Each JSON line (a `TrainerLine` of lorafleet_schemas.messages) becomes a
status report or a log line; the job keeps the done and error lines and
the peak MiB the trainer reported. A checkpoint line goes to the job's
CheckpointSender, which never waits: nothing here blocks the trainer's pipe.
A line that does not decode is logged (`trainer.line_bad`) and skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from lorafleet.estimate import EstimateError, estimate_memory
from lorafleet.log import Event
from lorafleet_schemas.messages import (
    JobState,
    StartRequest,
    TrainerCheckpoint,
    TrainerDone,
    TrainerError,
    TrainerEval,
    TrainerLengths,
    TrainerLine,
    TrainerLog,
    TrainerState,
    TrainerStep,
    TrainerYield,
)
from lorafleet_services.agent.training.status_reports import Reporter
from lorafleet_services.agent.training.yielding import YieldNotes
from lorafleet_services.agent.transfer.checkpoints import CheckpointSender

_line_decoder: msgspec.json.Decoder[TrainerLine] = msgspec.json.Decoder(TrainerLine)


#: A DPO job's numbers on a step line, and on an eval line.
PREFERENCE_FIELDS = ("rewards_chosen", "rewards_rejected", "margin", "accuracy")
EVAL_PREFERENCE_FIELDS = tuple(f"eval_{f}" for f in PREFERENCE_FIELDS)


def preference_of(line: TrainerStep | TrainerEval) -> dict[str, float] | None:
    """A DPO job's numbers a step or eval line carries (None: a supervised job's)."""
    names = PREFERENCE_FIELDS if isinstance(line, TrainerStep) else EVAL_PREFERENCE_FIELDS
    found = {n: v for n in names if (v := getattr(line, n)) is not None}
    return found or None


def lengths_note(line: TrainerLengths, req: StartRequest) -> str:
    """The trainer's token lengths as a progress message, with the memory
    estimate refined by them: a micro-batch's rows are as wide as its longest
    record, so the longest one seen replaces max_seq_len."""
    text = (
        f"tokenized {line.records_tokenized} records: {line.p50} tokens at the median, "
        f"{line.p95} at p95, {line.max} the longest; {line.records_cut} cut at max_seq_len "
        f"{req.params.max_seq_len}"
    )
    if req.model.architecture is None:
        return text
    try:
        refined = estimate_memory(
            req.model.architecture, req.params, seq_len=line.max, budget_mib=req.gpu_memory_mib
        )
    except EstimateError:
        return text
    return (
        f"{text}; memory estimate for rows of {refined.seq_len} tokens {refined.total_mib} MiB "
        f"(was {job_estimate_mib(req)} MiB for {req.params.max_seq_len}; the job has "
        f"{req.gpu_memory_mib} MiB)"
    )


def job_estimate_mib(req: StartRequest) -> int | None:
    """The job's memory estimate on a card, when its model's architecture is known."""
    if req.model.architecture is None:
        return None
    try:
        return estimate_memory(
            req.model.architecture, req.params, budget_mib=req.gpu_memory_mib
        ).total_mib
    except EstimateError:
        return None


class TrainerLines:
    """The trainer's stdout, line by line: status reports, log lines, and what
    the job keeps of it (the done and error lines, the peak MiB it reported).
    A checkpoint line goes to the job's CheckpointSender, which never waits."""

    def __init__(
        self, reporter: Reporter, req: StartRequest, logger: Any, sampled: Callable[[], int]
    ) -> None:
        self.reporter = reporter
        self.req = req
        self.logger = logger
        #: The NVML sampler's peak MiB so far.
        self.sampled = sampled
        self.done_line: TrainerDone | None = None
        self.error_line: str | None = None
        self.peak_trainer_mib = 0
        self.checkpoints: CheckpointSender | None = None
        self.yield_notes = YieldNotes()

    def peak(self) -> int:
        return max(self.peak_trainer_mib, self.sampled())

    async def __call__(self, raw: bytes) -> None:
        if not raw.strip():
            return
        try:
            line = _line_decoder.decode(raw)
        except msgspec.DecodeError as e:
            self.logger.warning(
                Event.TRAINER_LINE_BAD, error=str(e), line=raw[:200].decode(errors="replace")
            )
            return
        if isinstance(line, TrainerStep):
            self._step(line)
        elif isinstance(line, TrainerCheckpoint):
            self.logger.info(Event.TRAINER_LINE, message="checkpoint", step=line.step)
            if self.checkpoints is not None:
                self.checkpoints.offer(line)
        else:
            self._other(line)

    def _step(self, line: TrainerStep) -> None:
        self.peak_trainer_mib = max(self.peak_trainer_mib, line.peak_mib)
        peak = self.peak()
        self.reporter.report(
            step=line.step,
            steps=line.steps,
            loss=line.loss,
            learning_rate=line.learning_rate,
            tokens_per_s=line.tokens_per_s,
            eta_s=line.eta_s,
            peak_mib=peak,
            preference=preference_of(line),
        )
        self.logger.info(
            Event.JOB_PROGRESS, step=line.step, steps=line.steps, loss=line.loss, peak_mib=peak
        )

    def _other(self, line: TrainerLine) -> None:
        r = self.reporter
        if isinstance(line, TrainerState):
            if line.state == "running":
                r.report(JobState.RUNNING, line.message or "training")
            else:
                r.report(message=line.message or line.state)
            self.logger.info(Event.TRAINER_LINE, state=line.state, message=line.message)
        elif isinstance(line, TrainerEval):
            r.report(step=line.step, eval_loss=line.eval_loss, eval_preference=preference_of(line))
            self.logger.info(Event.JOB_EVAL, step=line.step, eval_loss=line.eval_loss)
        elif isinstance(line, TrainerLog):
            r.report(message=line.message)
            self.logger.info(Event.TRAINER_LINE, message=line.message, trainer_level=line.level)
        elif isinstance(line, TrainerError):
            self.error_line = line.message
            self.logger.warning(Event.TRAINER_LINE, error=line.message)
        elif isinstance(line, TrainerLengths):
            note = lengths_note(line, self.req)
            r.report(message=note)
            self.logger.info(Event.TRAINER_LINE, message=note)
        elif isinstance(line, TrainerYield):
            self.logger.info(Event.TRAINER_LINE, message=f"yield {line.state}", step=line.step,
                             cause=line.cause, paused_s=line.paused_s)  # fmt: skip
            said = self.yield_notes.message(line)
            if said is not None:
                r.report(message=said)
        elif isinstance(line, TrainerDone):
            self.done_line = line
            self.logger.info(Event.TRAINER_LINE, message="done", adapter_dir=line.adapter_dir)
