"""How a training job keeps to its memory budget: the plans params allow
(`candidate_plans`), what each costs in step time (`plan_cost`) and how the
trainer words it (`plan_words`); `choose_plan` answers the cheapest plan
whose estimate (lorafleet_trainer.memory), with the estimate's error, fits
a budget, or the one of the least estimate, marked as not fitting.
Standard library only.
"""

from __future__ import annotations

import dataclasses
import math

from lorafleet_trainer.memory import (
    ESTIMATE_ERROR_FRACTION,
    FRUGAL_HEAP_COST,
    PROCESS_MIB,
    RECOMPUTE_COST,
    SPLIT_COST,
    Knobs,
    Plan,
    Shapes,
    budget_for,
    checkpointed_layers,
    checkpointing_words,
    plan_mib,
)


def plan_words(plan: Plan, layers: int, batch_size: int, device: str) -> str:
    """The plan as the trainer logs it: its checkpointing, on the CPU its
    heap, and its forward passes when they split the micro-batch."""
    words = [checkpointing_words(plan.every, layers)]
    if device == "cpu":
        words.append("the frugal heap" if plan.frugal_heap else "the C library's heap")
    rows = plan.micro_rows
    if rows and rows < batch_size:
        words.append(f"forward passes of {rows} of the micro-batch's {batch_size} rows")
    return ", ".join(words)


def plan_cost(plan: Plan, layers: int, batch_size: int, device: str) -> float:
    """A step's time under `plan`, relative to none of it (the costs' constants)."""
    cost = 1.0 + RECOMPUTE_COST * checkpointed_layers(layers, plan.every) / max(layers, 1)
    if plan.frugal_heap:
        cost += FRUGAL_HEAP_COST
    rows = plan.micro_rows or batch_size
    if rows < batch_size:
        cost += SPLIT_COST[device] * math.log2(batch_size / rows)
    return cost


def candidate_plans(layers: int, params: Knobs, device: str) -> list[Plan]:
    """Every plan params allow: gradient_checkpointing true is every layer,
    false none, "auto" any interval (each that checkpoints one more layer
    than the one before); on the CPU either heap; forward passes of the
    micro-batch's rows halved down to one."""
    setting = params.gradient_checkpointing
    if isinstance(setting, bool):
        intervals = [1 if setting else 0]
    else:
        ks = {math.ceil(layers / m) for m in range(1, layers + 1)} if layers else {1}
        intervals = [0, *sorted(ks, reverse=True)]
    heaps = [False, True] if device == "cpu" else [False]
    rows, r = [params.batch_size], params.batch_size
    while r > 1:
        r = math.ceil(r / 2)
        rows.append(r)
    return [
        Plan(every, heap, 0 if n == params.batch_size else n)
        for every in intervals
        for heap in heaps
        for n in rows
    ]


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """The plan chosen for a job (`Plan`) over `layers` decoder layers, its
    estimate in MiB (0: none made), whether that fits the budget, and why it
    was chosen."""

    plan: Plan
    layers: int
    total_mib: int
    reason: str
    words: str
    fits: bool = True

    @property
    def every(self) -> int:
        return self.plan.every

    @property
    def message(self) -> str:
        """The choice and its reason, as the trainer logs it."""
        return f"{self.words}: {self.reason}"


def choose_plan(
    arch: Shapes,
    params: Knobs,
    device: str,
    seq_len: int,
    budget_mib: int | None,
    process_mib: int = PROCESS_MIB,
) -> MemoryPlan:
    """The cheapest plan (`plan_cost`) params allow whose estimate, with the
    estimate's error (`budget_for`), fits `budget_mib`; without a budget the
    default (no checkpointing unless params ask for it, the C library's heap,
    whole micro-batches); when none fits, the one of the least estimate
    (`fits` false; `budget_for` it is the smallest budget that would do)."""
    layers, batch = arch.num_hidden_layers, params.batch_size
    plans = candidate_plans(layers, params, device)

    def mib(plan: Plan) -> int:
        return plan_mib(arch, params, device, seq_len, plan, process_mib)

    def chosen(plan: Plan, total: int, reason: str, fits: bool = True) -> MemoryPlan:
        words = plan_words(plan, layers, batch, device)
        return MemoryPlan(plan, layers, total, reason, words, fits)

    first = plans[0]
    if budget_mib is None:
        setting = params.gradient_checkpointing
        fixed = f"params.gradient_checkpointing is {str(setting).lower()}; " * isinstance(
            setting, bool
        )
        return chosen(
            first, mib(first), f"{fixed}no memory budget; the estimate is {mib(first)} MiB"
        )
    totals = [(plan_cost(p, layers, batch, device), mib(p), p) for p in plans]
    fitting = [t for t in totals if budget_for(t[1]) <= budget_mib]
    margin = f"{ESTIMATE_ERROR_FRACTION:.0%}"
    if not fitting:
        _, least, plan = min(totals, key=lambda t: (t[1], t[0]))
        return chosen(
            plan,
            least,
            f"the least estimate, {least} MiB, and the estimate's error ({margin}: "
            f"{budget_for(least)} MiB) are over the budget of {budget_mib} MiB",
            fits=False,
        )
    cost, total, plan = min(fitting, key=lambda t: (t[0], t[1]))
    if plan == first:
        return chosen(
            plan,
            total,
            f"the estimate of {total} MiB and its error ({margin}) fit the budget of "
            f"{budget_mib} MiB",
        )
    return chosen(
        plan,
        total,
        f"the cheapest that fits the budget of {budget_mib} MiB: its estimate is {total} MiB "
        f"({budget_for(total)} MiB with its error of {margin}; without any of it "
        f"{mib(first)} MiB), its steps about {cost - 1:.0%} slower",
    )
