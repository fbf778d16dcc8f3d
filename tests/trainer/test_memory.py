"""The checkpointing choice (lorafleet_trainer.memory) and its application
to the model's layers (lorafleet_trainer.loop.enable_checkpointing)."""

from __future__ import annotations

import dataclasses

import pytest

from lorafleet_trainer import memory, plans
from lorafleet_trainer.loop import prepare_training
from lorafleet_trainer.params import Params
from tests.trainer.shapes import PEFT_DEPRECATION, bench_arch, cpu, tiny_llama

pytestmark = PEFT_DEPRECATION

ARCH = bench_arch(152_064)
PARAMS = Params(batch_size=8, max_seq_len=512, dtype="bf16")


def _mib(plan: memory.Plan, device: str = "cuda", params: Params = PARAMS) -> int:
    return memory.plan_mib(ARCH, params, device, 512, plan)


def test_auto_takes_the_least_checkpointing_that_fits() -> None:
    none, every_5th, every = _mib(memory.Plan()), _mib(memory.Plan(5)), _mib(memory.Plan(1))
    assert none > every_5th > every
    choose, need = plans.choose_plan, memory.budget_for
    assert choose(ARCH, PARAMS, "cuda", 512, None).plan == memory.Plan()
    assert choose(ARCH, PARAMS, "cuda", 512, need(none)).plan == memory.Plan()
    # The estimate alone is not enough: its error is the first step's margin.
    assert choose(ARCH, PARAMS, "cuda", 512, none).plan != memory.Plan()
    # Every 10th (1 layer), 5th (2), 4th (3), ...: the first that fits,
    # cheaper on a card than forward passes of half the rows.
    budget = need(every_5th)
    fit = choose(ARCH, PARAMS, "cuda", 512, budget)
    assert fit.plan == memory.Plan(5) and fit.total_mib == every_5th and fit.fits
    assert fit.message == (
        "gradient checkpointing every 5th layer (2 of 10): the cheapest that fits the budget "
        f"of {budget} MiB: its estimate is {every_5th} MiB ({budget} MiB with its error of 10%; "
        f"without any of it {none} MiB), its steps about 6% slower"
    )
    # Below every layer's estimate: forward passes of fewer rows too.
    short = choose(ARCH, PARAMS, "cuda", 512, need(every) - 1)
    assert short.plan.every == 1 and 0 < short.plan.micro_rows < 8 and short.fits
    for fixed, want in ((True, 1), (False, 0)):
        p = dataclasses.replace(PARAMS, gradient_checkpointing=fixed)
        assert choose(ARCH, p, "cuda", 512, 10**6).every == want
        assert {c.every for c in plans.candidate_plans(10, p, "cuda")} == {want}


def test_the_plans_on_the_cpu_are_checkpointing_heap_and_forward_passes() -> None:
    cpu = dataclasses.replace(PARAMS, dtype="fp32")
    every = plans.candidate_plans(10, cpu, "cpu")
    assert {p.frugal_heap for p in every} == {False, True}
    assert {p.micro_rows for p in every} == {0, 4, 2, 1}
    assert {p.every for p in every} == {0, 10, 5, 4, 3, 2, 1}
    assert plans.candidate_plans(10, PARAMS, "cuda") == [p for p in every if not p.frugal_heap]
    lines = dict((n, b) for n, b, _ in memory.estimate_lines(ARCH, cpu, "cpu", 512, 0))
    assert lines["process"] == memory.PROCESS_MIB * memory.MIB
    acts = lines["activations"]
    want = int(acts * memory.HEAP_SLACK_FRACTION) + memory.HEAP_SLACK_MIB * memory.MIB
    assert lines["heap slack"] == want
    # The frugal heap keeps no holes; checkpointing leaves the heap's slack
    # (a rebuilt layer makes its transient tensors all the same).
    frugal = memory.estimate_lines(ARCH, cpu, "cpu", 512, 0, frugal_heap=True)
    assert dict((n, b) for n, b, _ in frugal)["heap slack"] == memory.HEAP_SLACK_MIB * memory.MIB
    ckpt = dict((n, b) for n, b, _ in memory.estimate_lines(ARCH, cpu, "cpu", 512, 1))
    assert ckpt["heap slack"] == want and ckpt["activations"] < acts / 5
    half = dict((n, b) for n, b, _ in memory.estimate_lines(ARCH, cpu, "cpu", 512, 0, micro_rows=4))
    assert half["activations"] < acts * 0.55 and half["heap slack"] < want


@pytest.mark.parametrize("budget_share", [1.0, 0.7, 0.5, 0.35, 0.25])
def test_the_cpu_takes_the_cheapest_plan_that_fits(budget_share: float) -> None:
    cpu = dataclasses.replace(PARAMS, dtype="fp32")
    default = _mib(memory.Plan(), "cpu", cpu)
    budget = int(memory.budget_for(default) * budget_share)
    choice = plans.choose_plan(ARCH, cpu, "cpu", 512, budget)
    assert choice.fits and choice.total_mib == _mib(choice.plan, "cpu", cpu)
    assert memory.budget_for(choice.total_mib) <= budget
    cost = plans.plan_cost(choice.plan, 10, 8, "cpu")
    for plan in plans.candidate_plans(10, cpu, "cpu"):
        if plans.plan_cost(plan, 10, 8, "cpu") < cost:  # a cheaper one would not fit
            assert memory.budget_for(_mib(plan, "cpu", cpu)) > budget, plan
    assert (choice.plan == memory.Plan()) is (budget_share == 1.0)


def test_a_budget_below_every_plan_is_answered_with_the_least() -> None:
    cpu = dataclasses.replace(PARAMS, dtype="fp32")
    least = min(_mib(p, "cpu", cpu) for p in plans.candidate_plans(10, cpu, "cpu"))
    need = memory.budget_for(least)
    over = plans.choose_plan(ARCH, cpu, "cpu", 512, need - 1)
    assert not over.fits and over.total_mib == least
    assert over.plan == memory.Plan(1, True, 1)
    assert over.reason == (
        f"the least estimate, {least} MiB, and the estimate's error (10%: {need} MiB) are over "
        f"the budget of {need - 1} MiB"
    )
    assert plans.choose_plan(ARCH, cpu, "cpu", 512, need).fits


def test_the_logits_line_is_one_chunk_not_the_whole_batch() -> None:
    tokens = 8 * 512
    chunk = memory.loss_chunk_bytes(ARCH, tokens, "bf16")
    assert memory.chunk_rows(ARCH.vocab_size) == 110
    assert chunk == 110 * 152_064 * (4 + 4 + 2)
    # The whole logits in fp32 alone were 2.3 GiB; a chunk is under 200 MiB.
    assert chunk < tokens * ARCH.vocab_size * 4 / 12


@pytest.mark.parametrize(("every", "flags"), [(2, [1, 0, 1, 0]), (3, [1, 0, 0, 1]), (1, [1] * 4)])
def test_every_kth_layer_is_checkpointed_and_rebuilt(every: int, flags: list[int]) -> None:
    import torch

    model = tiny_llama(4)
    loop = prepare_training(model, Params(rank=2), "fp32", cpu(), 1, every)
    layers = model.model.layers
    assert [int(layer.gradient_checkpointing) for layer in layers] == flags
    calls = [0] * len(layers)
    for i, layer in enumerate(layers):
        # A pre-hook: torch stops a layer's recomputation once it has what
        # the backward pass needs, before the layer's last modules return.
        layer.input_layernorm.register_forward_pre_hook(
            lambda *_, i=i: calls.__setitem__(i, calls[i] + 1)
        )
    ids = torch.randint(0, 64, (2, 12))
    loop.model(input_ids=ids, labels=ids).loss.backward()
    # A checkpointed layer runs again in the backward pass.
    assert calls == [1 + f for f in flags]
