"""The trainer's JSON-lines protocol: one tagged line per event on its stdout,
read by the agent."""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class TrainerState(msgspec.Struct, kw_only=True, tag="state", tag_field="event"):
    """A state change inside the trainer: "preparing" (loading), "running", "saving"."""

    state: Literal["preparing", "running", "saving"]
    #: "preparing" repeats while the records are tokenized ("tokenizing: N of M records").
    message: str = ""


class TrainerStep(msgspec.Struct, kw_only=True, tag="step", tag_field="event", omit_defaults=True):
    """One optimizer step. Encoded without its defaults: a supervised job's
    line has no DPO fields."""

    step: int
    steps: int
    #: The mean over the step's micro-batches.
    loss: float
    learning_rate: float
    #: Real tokens, padding not counted.
    tokens_per_s: float
    eta_s: float
    #: The process's peak so far: torch's peak reserved MiB and the CUDA
    #: context on a card, the peak RSS MiB on the CPU.
    peak_mib: int
    #: Counted from 1.
    epoch: int = 0
    #: A DPO job's (params.method "dpo"), the means over the step's pairs:
    #: each answer's reward, beta * (its log-probability under the adapter
    #: less under the model without it); their difference; the share of
    #: pairs whose chosen answer has the higher reward. None otherwise.
    rewards_chosen: float | None = None
    rewards_rejected: float | None = None
    margin: float | None = None
    accuracy: float | None = None


class TrainerEval(msgspec.Struct, kw_only=True, tag="eval", tag_field="event", omit_defaults=True):
    step: int
    epoch: int
    #: After each epoch and at the end, when there is an evaluation set: the
    #: mean cross-entropy per answer token over it (a DPO job's: the mean
    #: DPO loss per pair).
    eval_loss: float
    #: A DPO job's, over the held-out pairs (as TrainerStep's); None otherwise.
    eval_rewards_chosen: float | None = None
    eval_rewards_rejected: float | None = None
    eval_margin: float | None = None
    eval_accuracy: float | None = None


class TrainerLog(msgspec.Struct, kw_only=True, tag="log", tag_field="event"):
    """Something a person should read (records cut at max length, ...)."""

    #: The first names the process: "uid=... gid=... pid=..." (the stand-in's:
    #: "pid=... child_pid=...").
    message: str
    level: Literal["info", "warning"] = "info"


class TrainerDone(msgspec.Struct, kw_only=True, tag="done", tag_field="event"):
    adapter_dir: str
    #: The directory the base weights were read from (the GGUF conversion needs it).
    base_dir: str
    summary: dict[str, Any] = msgspec.field(default_factory=dict)


class TrainerError(msgspec.Struct, kw_only=True, tag="error", tag_field="event"):
    #: Printed before a failure's exit when it can be.
    message: str


class TrainerCheckpoint(msgspec.Struct, kw_only=True, tag="checkpoint", tag_field="event"):
    """A complete checkpoint is on disk (written to a temporary name, then
    renamed): the state after optimizer step `step`."""

    #: It may come a few steps after its step: the writing is off the training loop.
    step: int
    #: The checkpoint directory (lorafleet_trainer.layout).
    path: str
    epoch: int = 0


class TrainerLengths(msgspec.Struct, kw_only=True, tag="lengths", tag_field="event"):
    """The token lengths of the records tokenized before the weights load (all
    of them without max_steps; with it, those its steps read)."""

    records_tokenized: int
    records_cut: int
    records_skipped: int
    min: int
    p50: int
    p95: int
    max: int
    mean: int


class TrainerYield(msgspec.Struct, kw_only=True, tag="yield", tag_field="event"):
    """The trainer yields to the node's engines: "paused" between two steps
    once it sees the agent's pause file (`cause`: the file's text), then
    "resumed" when the file is gone (`paused_s`: the wait)."""

    state: Literal["paused", "resumed"]
    #: The optimizer steps done when it paused.
    step: int
    cause: str = ""
    paused_s: float = 0.0


TrainerLine = (
    TrainerState
    | TrainerStep
    | TrainerEval
    | TrainerLog
    | TrainerDone
    | TrainerError
    | TrainerLengths
    | TrainerCheckpoint
    | TrainerYield
)
