"""The budget kept as the trainer goes (lorafleet_trainer.guard): the step's
peak read, the plan tightened before a step predicted to pass the budget,
the micro-batch split into forward passes whose gradients add up to its
own, and the process's peak read step by step (budget.PeakMeter)."""

from __future__ import annotations

import dataclasses
import io
import json
import math
from typing import Any

import pytest

from lorafleet_trainer import memory, plans
from lorafleet_trainer.batches import split_batch, to_batch
from lorafleet_trainer.budget import PeakMeter
from lorafleet_trainer.guard import (
    HEADROOM_FRACTION,
    MemoryGuard,
    Sizing,
    pass_rows,
    smallest_budget_mib,
    tighter_plan,
)
from lorafleet_trainer.loop import (
    Progress,
    _accumulate,
    enable_checkpointing,
    prepare_training,
    train_steps,
)
from lorafleet_trainer.params import Params
from lorafleet_trainer.protocol import LineWriter, TrainingFailureError
from lorafleet_trainer.rendering import IGNORE, Encoded
from tests.trainer.shapes import PEFT_DEPRECATION, bench_arch, cpu, tiny_llama

pytestmark = PEFT_DEPRECATION

ARCH = bench_arch(32_000)
PARAMS = Params(batch_size=8, max_seq_len=512, dtype="fp32")
SIZING = Sizing(ARCH, PARAMS, "cpu", 400, 512)


def _rows(n: int, width: int, prompt: int = 4) -> list[Encoded]:
    return [
        Encoded(
            list(range(1, width + 1)),
            [IGNORE] * prompt + list(range(prompt + 1, width + 1)),
            cut=False,
        )
        for _ in range(n)
    ]


def test_forward_passes_hold_the_plans_tokens_and_no_more_rows_than_the_batch() -> None:
    assert pass_rows(0, 512, 8) == 0  # whole
    assert pass_rows(2 * 512, 512, 8) == 2
    assert pass_rows(2 * 512, 128, 8) == 0  # 8 narrow rows fit: no split
    assert pass_rows(2 * 512, 256, 8) == 4
    assert pass_rows(2 * 512, 5000, 8) == 1  # never below one row
    half = Sizing(ARCH, PARAMS, "cpu", 400, 512)
    plan = memory.Plan(micro_rows=2)
    assert half.mib(plan, 512) == memory.plan_mib(ARCH, PARAMS, "cpu", 512, plan, 400)
    assert half.mib(plan, 128) == memory.plan_mib(ARCH, PARAMS, "cpu", 128, memory.Plan(), 400)


def test_a_tighter_plan_has_less_memory_and_fits_with_the_measured_ratio() -> None:
    now = memory.Plan()
    current = SIZING.mib(now, 512)
    budget = int(current * 0.6)
    plan = tighter_plan(SIZING, now, 512, 1.0, budget)
    assert plan is not None and SIZING.mib(plan, 512) <= budget * (1 - HEADROOM_FRACTION)
    # A worse ratio of peaks to estimates asks for a tighter one still.
    worse = tighter_plan(SIZING, now, 512, 1.3, budget)
    assert worse is not None and SIZING.mib(worse, 512) * 1.3 <= budget * (1 - HEADROOM_FRACTION)
    assert SIZING.mib(worse, 512) <= SIZING.mib(plan, 512)
    least = min(SIZING.mib(p, 512) for p in plans.candidate_plans(10, PARAMS, "cpu"))
    assert tighter_plan(SIZING, now, 512, 1.0, least) is None  # no room for the headroom
    assert smallest_budget_mib(SIZING, 512, 1.0) == least
    assert smallest_budget_mib(SIZING, 512, 1.5) == math.ceil(least * 1.5)


def test_the_guard_tightens_before_a_step_that_would_pass_and_fails_when_nothing_fits() -> None:
    out = io.StringIO()
    step = [to_batch(_rows(8, 512), 0, cpu())]
    budget = int(SIZING.mib(memory.Plan(), 512) * 0.8)
    guard = MemoryGuard(SIZING, budget, memory.Plan(), PeakMeter(cpu()), LineWriter(out))
    applied: list[memory.Plan] = []
    guard.apply = applied.append
    guard.before_step(1, step)
    assert applied and applied[-1] == guard.plan and guard.tightened == 1
    # Before any step was measured, the estimate's error is the ratio.
    assert guard.ratio == 1 + memory.ESTIMATE_ERROR_FRACTION
    assert SIZING.mib(guard.plan, 512) * guard.ratio <= budget * (1 - HEADROOM_FRACTION)
    log = json.loads(out.getvalue().splitlines()[-1])["message"]
    assert log.startswith("memory plan tightened before step 1 to ")
    assert f"neared the budget of {budget} MiB" in log
    # Steps that fit leave the plan alone.
    guard.before_step(2, step)
    assert guard.tightened == 1
    # The least plan, near the budget it was chosen for but under it:
    # nothing has less, so on.
    least = memory.Plan(1, True, 1)
    budget_least = memory.budget_for(SIZING.mib(least, 512))
    near = MemoryGuard(SIZING, budget_least, least, PeakMeter(cpu()), LineWriter(out))
    near.before_step(1, step)
    assert near.plan == least and near.tightened == 0
    # Peaks measured at five times their estimates: nothing is left that fits.
    guard.measured, guard.ratio = True, 5.0
    with pytest.raises(TrainingFailureError) as e:
        guard.before_step(3, step)
    need = smallest_budget_mib(SIZING, 512, 5.0)
    assert f"the smallest budget that would do is {need} MiB" in str(e.value)
    assert f"would pass the memory budget of {budget} MiB" in str(e.value)


def test_step_1_goes_by_the_estimates_error_and_later_steps_by_the_measured_peaks() -> None:
    step = [to_batch(_rows(8, 512), 0, cpu())]
    plan = memory.Plan()
    estimate = SIZING.mib(plan, 512)
    # The plan's estimate fits the budget with the headroom to spare, with
    # its error it does not: step 1 gets a tighter plan, before any peak.
    budget = math.ceil(estimate / (1 - HEADROOM_FRACTION)) + 1
    first = MemoryGuard(SIZING, budget, plan, PeakMeter(cpu()), LineWriter(io.StringIO()))
    first.before_step(1, step)
    assert first.tightened == 1 and SIZING.mib(first.plan, 512) < estimate
    # Measured (this process, far under the bench model's estimate), the
    # ratio is the measurement's, lower than the prior; then the worst.
    guard = MemoryGuard(SIZING, 10 * estimate, plan, PeakMeter(cpu()), LineWriter(io.StringIO()))
    guard.before_step(1, step)
    peak = guard.after_step()
    assert guard.ratio == peak / estimate < 1 + memory.ESTIMATE_ERROR_FRACTION
    block = bytearray(200 << 20)  # touched: a higher peak in step 2
    guard.before_step(2, step)
    second = guard.after_step()
    del block
    assert second > peak and guard.ratio == second / estimate
    guard.before_step(3, step)
    guard.after_step()
    assert guard.ratio == second / estimate  # the worst is kept
    # The least plan at its bare estimate: the prior fails no job before
    # step 1 (nothing is tighter); a measured ratio over the budget does.
    least = memory.Plan(1, True, 1)
    bare = SIZING.mib(least, 512)
    tight = MemoryGuard(SIZING, bare, least, PeakMeter(cpu()), LineWriter(io.StringIO()))
    tight.before_step(1, step)
    tight.measured, tight.ratio = True, 1.2
    with pytest.raises(TrainingFailureError):
        tight.before_step(2, step)


def test_a_step_that_ran_out_of_the_cards_budget_tightens_and_fails_when_nothing_is_left() -> None:
    out = io.StringIO()
    step = [to_batch(_rows(8, 512), 0, cpu())]
    estimate = SIZING.mib(memory.Plan(), 512)
    budget = estimate * 2  # predicted to fit, with room: only running out tightens
    guard = MemoryGuard(SIZING, budget, memory.Plan(), PeakMeter(cpu()), LineWriter(out))
    applied: list[memory.Plan] = []
    guard.apply = applied.append
    guard.before_step(1, step)
    assert guard.tightened == 0
    assert guard.out_of_memory(1, "CUDA out of memory. Tried to allocate 64.00 MiB")
    # Its peak was over the budget: the ratio is at least the budget over its estimate.
    assert guard.measured and guard.ratio == budget / estimate
    assert applied == [guard.plan] and guard.tightened == 1
    assert SIZING.mib(guard.plan, 512) * guard.ratio <= budget * (1 - HEADROOM_FRACTION)
    log = json.loads(out.getvalue().splitlines()[-1])["message"]
    assert log.startswith(
        f"memory plan tightened at step 1, which ran out of the budget of {budget}"
    )
    assert log.endswith("the step is done again")
    # The least plan ran out: nothing has less.
    least = memory.Plan(1, True, 1)
    tight = MemoryGuard(SIZING, budget, least, PeakMeter(cpu()), LineWriter(out))
    tight.before_step(1, step)
    with pytest.raises(TrainingFailureError) as e:
        tight.out_of_memory(1, "CUDA out of memory. Tried to allocate 64.00 MiB")
    assert f"step 1 ran out of the memory budget of {budget} MiB" in str(e.value)
    assert "(CUDA out of memory)" in str(e.value)
    assert "the smallest budget that would do is " in str(e.value)
    # Without a budget the error stands (the loop raises it).
    assert not MemoryGuard(None, None, memory.Plan(), PeakMeter(cpu())).out_of_memory(1, "x")


def test_the_loop_does_a_step_that_ran_out_again_under_the_tighter_plan() -> None:
    """The card's allocator cap is the one thing here that cannot exist on
    the CPU: a forward hook raises torch's own OutOfMemoryError for a pass of
    more than 2 rows, as the cap would."""
    import torch

    loop = prepare_training(tiny_llama(2), Params(rank=4, dropout=0.0), "fp32", cpu(), 1)
    out = io.StringIO()
    guard = MemoryGuard(
        SIZING, SIZING.mib(memory.Plan(), 512) * 2, memory.Plan(), PeakMeter(cpu()), LineWriter(out)
    )
    widest = 512  # the guard sizes the bench's model at the batch's width

    def apply(plan: memory.Plan) -> None:
        enable_checkpointing(loop.model, plan.every)
        loop.micro_tokens = plan.micro_rows * widest

    guard.apply = apply
    loop.guard = guard
    passes: list[int] = []

    def cap(module: Any, args: Any) -> None:
        rows = int(args[0].shape[0])  # the embedding's ids: the pass's rows
        passes.append(rows)
        if rows > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB")

    loop.model.get_input_embeddings().register_forward_pre_hook(cap)
    ids = [1 + i % 63 for i in range(512)]  # the tiny model's 64 tokens
    encoded = [Encoded(ids, [IGNORE] * 4 + ids[4:], cut=False) for _ in range(8)]
    steps = [(0, [to_batch(encoded, 0, cpu())]) for _ in range(3)]
    lines: list[dict[str, Any]] = []
    train_steps(loop, iter(steps), 3, Progress(), lines.append)
    assert [line["step"] for line in lines] == [1, 2, 3]
    assert guard.tightened >= 1 and 1 <= guard.plan.micro_rows <= 2, guard.plan
    assert max(passes[-12:]) <= 2  # every pass since, of the plan's rows
    # The optimizer stepped once a step: the attempts that ran out left nothing.
    state = loop.optimizer.state[next(p for p in loop.model.parameters() if p.requires_grad)]
    assert int(state["step"]) == 3
    assert "which ran out of the budget of" in out.getvalue()


def test_forward_passes_of_fewer_rows_give_the_micro_batchs_gradients() -> None:
    import torch

    def grads(rows: int, every: int) -> list[Any]:
        loop = prepare_training(tiny_llama(2), Params(rank=4, dropout=0.0), "fp32", cpu(), 1)
        enable_checkpointing(loop.model, every)  # after peft: a tightened plan's
        # Rows of unlike lengths (padded) and answer counts.
        encoded = [
            Encoded(list(range(1, n + 1)), [IGNORE] * 3 + list(range(4, n + 1)), cut=False)
            for n in (12, 9, 7, 12, 5)
        ]
        batch = to_batch(encoded, 0, cpu())
        loop.micro_tokens = rows * 12
        _accumulate(loop, [batch, to_batch(encoded[:2], 0, cpu())])
        return [p.grad.clone() for p in loop.model.parameters() if p.requires_grad]

    whole = grads(0, 0)
    for rows, every in ((2, 0), (1, 0), (2, 1)):
        for a, b in zip(whole, grads(rows, every), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_a_split_batch_keeps_each_rows_answers() -> None:
    batch = to_batch(_rows(3, 10, prompt=4) + _rows(2, 6, prompt=5), 0, cpu())
    parts = split_batch(batch, 2)
    assert [int(p.input_ids.shape[0]) for p in parts] == [2, 2, 1]
    assert sum(p.answer_tokens for p in parts) == batch.answer_tokens
    assert [p.answer_tokens for p in parts] == [12, 6 + 1, 1]
    assert split_batch(batch, 0) == [batch] and split_batch(batch, 5) == [batch]
    # A part without an answer token is left out.
    none = to_batch(_rows(1, 10) + _rows(1, 10, prompt=10), 0, cpu())
    assert len(split_batch(none, 1)) == 1


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/clear_refs"), reason="Linux")
def test_the_meter_reads_each_steps_own_peak() -> None:
    meter = PeakMeter(cpu())
    meter.read()
    block = bytearray(300 << 20)  # touched: resident
    del block
    first = meter.read()
    second = meter.read()
    assert first >= second + 250, (first, second)
    assert meter.process_peak_mib == first
    # A plan's fields, as the summary writes them.
    assert dataclasses.asdict(memory.Plan(2, True, 1)) == {
        "every": 2,
        "frugal_heap": True,
        "micro_rows": 1,
    }
