"""The budget kept, not only estimated: the process's peak read after each
step, and the memory plan tightened before a step that would pass it.

`MemoryGuard.before_step(micro)` predicts the coming step's peak: its
estimate (lorafleet_trainer.memory, for rows as wide as the step's widest)
times the worst ratio of a measured peak to the highest estimate of a step
so far (a narrow step's peak is held against the widest before it, whose
pages the heap may keep); until a step was measured, 1 plus the estimate's
error (memory.ESTIMATE_ERROR_FRACTION), as the plan was chosen: the peak is
read only after a step, so step 1 goes by the estimate alone. When that comes
within HEADROOM_FRACTION of the budget, the guard moves to the cheapest
plan whose prediction fits (`tighter_plan`: more checkpointing, the frugal
heap, forward passes of fewer rows, each with less memory than the plan it
replaces) and logs which and why; when none fits, TrainingFailureError
names the smallest budget that would. `after_step()` reads the step's peak
(`PeakMeter`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from lorafleet_trainer import memory, plans
from lorafleet_trainer.batches import Batch
from lorafleet_trainer.budget import PeakMeter, process_rss_mib
from lorafleet_trainer.memory import Plan
from lorafleet_trainer.protocol import LineWriter, TrainingFailureError

#: How near the budget a predicted peak may come before the plan tightens:
#: a step's peak varies a little with its batch's lengths beyond what its
#: widest row says, and glibc's heap grows over the first steps.
HEADROOM_FRACTION = 0.04


@dataclasses.dataclass
class Sizing:
    """What the guard estimates with: the model's shapes, the parameters,
    the device type ("cpu", "cuda"), the process's own MiB and the longest
    row the plan was chosen for (its forward passes hold at most
    `micro_rows` rows of that many tokens: more of narrower rows)."""

    arch: memory.Shapes
    params: memory.Knobs
    device: str
    process_mib: int
    longest: int

    def rows(self, plan: Plan, width: int) -> int:
        """The rows of a forward pass under `plan` for rows `width` tokens wide
        (0: the whole micro-batch)."""
        return pass_rows(plan.micro_rows * self.longest, width, self.params.batch_size)

    def mib(self, plan: Plan, width: int) -> int:
        at_width = dataclasses.replace(plan, micro_rows=self.rows(plan, width))
        return memory.plan_mib(
            self.arch, self.params, self.device, width, at_width, self.process_mib
        )

    def recount_process(self) -> None:
        """The process's own MiB again, once the weights are loaded: its RSS
        less the weights and the adapter (the libraries the loading imported,
        beside the weights, count too)."""
        rss = process_rss_mib()
        if rss is None:
            return
        lines = memory.plan_lines(self.arch, self.params, self.device, 1, Plan(), 0)
        tensors = sum(b for name, b, _ in lines if name in ("weights", "adapter")) // memory.MIB
        self.process_mib = max(self.process_mib, rss - tensors)


def pass_rows(micro_tokens: int, width: int, batch_size: int) -> int:
    """The rows of a forward pass of at most `micro_tokens` tokens (0: the
    whole micro-batch, answered as 0) of rows `width` tokens wide."""
    if micro_tokens <= 0:
        return 0
    rows = max(1, micro_tokens // max(width, 1))
    return 0 if rows >= batch_size else rows


def tighter_plan(
    sizing: Sizing, current: Plan, width: int, ratio: float, budget_mib: int
) -> Plan | None:
    """The cheapest plan the parameters allow with less memory than
    `current` at rows `width` tokens wide whose estimate times `ratio` fits
    within HEADROOM_FRACTION of `budget_mib`; None when none does."""
    layers, batch = sizing.arch.num_hidden_layers, sizing.params.batch_size
    now = sizing.mib(current, width)
    limit = budget_mib * (1 - HEADROOM_FRACTION)
    fitting = [
        (plans.plan_cost(p, layers, batch, sizing.device), mib, p)
        for p in plans.candidate_plans(layers, sizing.params, sizing.device)
        if (mib := sizing.mib(p, width)) < now and mib * ratio <= limit
    ]
    return min(fitting, key=lambda t: (t[0], t[1]))[2] if fitting else None


def smallest_budget_mib(sizing: Sizing, width: int, ratio: float) -> int:
    """The least budget any allowed plan would keep to for rows `width`
    tokens wide, by the estimate times `ratio`."""
    every = plans.candidate_plans(sizing.arch.num_hidden_layers, sizing.params, sizing.device)
    least = min(sizing.mib(p, width) for p in every)
    return math.ceil(least * max(ratio, 1.0))


def plan_words(sizing: Sizing, plan: Plan) -> str:
    """What `plan` does, in words, for the log."""
    layers, batch = sizing.arch.num_hidden_layers, sizing.params.batch_size
    return plans.plan_words(plan, layers, batch, sizing.device)


def step_width(micro: list[Batch]) -> int:
    """The widest row of a step's micro-batches, in tokens."""
    return max(int(b.input_ids.shape[1]) for b in micro)


class MemoryGuard:
    """Keeps the training loop's steps under `budget_mib` (None: only reads
    the peak). `apply(plan)` changes the running loop to a plan."""

    def __init__(
        self,
        sizing: Sizing | None,
        budget_mib: int | None,
        plan: Plan,
        meter: PeakMeter,
        lines: LineWriter | None = None,
    ) -> None:
        self.sizing, self.budget_mib, self.plan = sizing, budget_mib, plan
        self.meter, self.lines = meter, lines
        #: A step's peak over its estimate: before any step was measured the
        #: estimate's error (memory.ESTIMATE_ERROR_FRACTION), after it the
        #: worst measured.
        self.ratio = 1 + memory.ESTIMATE_ERROR_FRACTION
        self.measured = False
        self.width = 0
        #: The highest estimate of a step under the plan: what a narrower
        #: step's peak is held against (the heap keeps the wider one's pages).
        self.high_mib = 0
        self.apply: Any = None
        self.tightened = 0

    def before_step(self, step: int, micro: list[Batch]) -> None:
        """Tighten the plan when the step's predicted peak nears the budget."""
        self.width = step_width(micro)
        if self.sizing is None or self.budget_mib is None or self.lines is None:
            return
        estimate = self.sizing.mib(self.plan, self.width)
        predicted = estimate * self.ratio
        if predicted <= self.budget_mib * (1 - HEADROOM_FRACTION):
            return
        plan = tighter_plan(self.sizing, self.plan, self.width, self.ratio, self.budget_mib)
        if plan is None and predicted <= self.budget_mib:
            return  # near, not over, and nothing has less: the headroom is spent
        if plan is None and not self.measured and estimate <= self.budget_mib:
            # The error is a prior, not a measurement: it chooses a tighter
            # plan where there is one, but fails no job the plan was chosen
            # for (the process counted again after loading may have eaten
            # into it); step 1's peak decides.
            return
        if plan is None:
            need = smallest_budget_mib(self.sizing, self.width, self.ratio)
            raise TrainingFailureError(
                f"step {step} would pass the memory budget of {self.budget_mib} MiB (the job's "
                f"gpu_memory_mib): its predicted peak is {predicted:.0f} MiB, the peaks so far "
                f"{self.ratio:.2f}x their estimates, and no plan has less; the smallest budget "
                f"that would do is {need} MiB, or lower batch_size or max_seq_len"
            )
        after = self.sizing.mib(plan, self.width) * self.ratio
        self._move_to(
            plan,
            f"memory plan tightened before step {step} to {plan_words(self.sizing, plan)}: "
            f"its predicted peak {predicted:.0f} MiB (rows of {self.width} tokens, the peaks "
            f"so far {self.ratio:.2f}x their estimates) neared the budget of "
            f"{self.budget_mib} MiB; now {after:.0f} MiB",
            self.lines,
        )

    def out_of_memory(self, step: int, error: str) -> bool:
        """A step ran out of the card's budget (torch's allocator reached its
        cap) though predicted to fit: its peak was over the budget, so the
        ratio is at least the budget over its estimate. Moves to the cheapest
        plan that fits by that ratio and answers True (the loop does the step
        again); answers False without a budget (the error stands), and raises
        TrainingFailureError naming the smallest budget when nothing fits."""
        if self.sizing is None or self.budget_mib is None or self.lines is None:
            return False
        estimate = self.sizing.mib(self.plan, self.width)
        self.ratio = max(self.ratio, self.budget_mib / estimate)
        self.measured = True
        self.meter.read()  # the failed attempt's peak: not the next step's
        plan = tighter_plan(self.sizing, self.plan, self.width, self.ratio, self.budget_mib)
        if plan is None:
            need = smallest_budget_mib(
                self.sizing, self.width, self.ratio * (1 + HEADROOM_FRACTION)
            )
            raise TrainingFailureError(
                f"step {step} ran out of the memory budget of {self.budget_mib} MiB (the job's "
                f"gpu_memory_mib) with no plan left that has less ({error.split('.')[0]}); the "
                f"smallest budget that would do is {need} MiB, or lower batch_size or max_seq_len"
            )
        self._move_to(
            plan,
            f"memory plan tightened at step {step}, which ran out of the budget of "
            f"{self.budget_mib} MiB under its estimate of {estimate} MiB, to "
            f"{plan_words(self.sizing, plan)}; the step is done again",
            self.lines,
        )
        return True

    def _move_to(self, plan: Plan, message: str, lines: LineWriter) -> None:
        lines.log(message)
        self.plan = plan
        self.high_mib = 0
        self.tightened += 1
        if self.apply is not None:
            self.apply(plan)

    def after_step(self) -> int:
        """The step's peak MiB; its ratio to the highest estimate of a step
        under the plan so far kept when worse."""
        peak = self.meter.read()
        if self.sizing is not None and self.width:
            self.high_mib = max(self.high_mib, self.sizing.mib(self.plan, self.width))
            ratio = peak / self.high_mib
            self.ratio = max(self.ratio, ratio) if self.measured else ratio
            self.measured = True
        return peak
