"""The training loop: LoRA on the base (peft), optimizer steps over the data
plan, an eval after each epoch, a checkpoint when due.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, cast

from lorafleet_trainer.batches import Batch, plan_grouped, split_batch, to_batch
from lorafleet_trainer.budget import PeakMeter, release_card_cache
from lorafleet_trainer.guard import MemoryGuard, pass_rows
from lorafleet_trainer.loss import answer_loss, kernel_name
from lorafleet_trainer.memory import Plan
from lorafleet_trainer.params import Params
from lorafleet_trainer.protocol import (
    BadInputError,
    Event,
    LineWriter,
    PauseGate,
    TrainingFailureError,
    is_out_of_memory,
)
from lorafleet_trainer.rendering import Tokens


class Objective(Protocol):
    """A training objective other than the answers' cross-entropy (DPO's:
    lorafleet_trainer.preference): a step's forward and backward passes, the
    numbers its step line adds, and the evaluation of the held-out records."""

    def accumulate(self, loop: Loop, micro: list[Batch]) -> Any: ...

    def step_metrics(self) -> dict[str, float]: ...

    def evaluate(
        self, loop: Loop, tokens: Tokens, held: Sequence[int], p: Params
    ) -> dict[str, float]: ...


@dataclasses.dataclass
class Loop:
    """What the training loop needs, built by `prepare_training`."""

    model: Any
    optimizer: Any
    scheduler: Any
    scaler: Any
    autocast: Callable[[], contextlib.AbstractContextManager[Any]]
    device: Any
    #: The loss's kernel (lorafleet_trainer.loss.kernel_name).
    loss_kernel: str = "torch"
    #: Tokens (rows x width) per forward pass (0: the whole micro-batch; the
    #: memory plan's rows at the width it was chosen for).
    micro_tokens: int = 0
    #: Reads each step's peak (and, given a budget, keeps the steps within it).
    guard: MemoryGuard | None = None
    #: Waits between steps while the agent yields to the engine's users.
    gate: PauseGate | None = None
    #: None: the answers' cross-entropy.
    objective: Objective | None = None


@dataclasses.dataclass
class Progress:
    step: int = 0
    tokens: int = 0
    padding: int = 0
    train_s: float = 0.0
    last_loss: float | None = None
    last_eval: float | None = None


def peak_mib(loop: Loop) -> int:
    """The process's peak so far: torch's peak reserved MiB on a card, the
    peak RSS on the CPU (lorafleet_trainer.budget.PeakMeter)."""
    if loop.guard is None:
        return 0
    loop.guard.meter.read()  # since the last step's reading: the eval's, the saving's
    return loop.guard.meter.process_peak_mib


def _accumulate(loop: Loop, micro: list[Batch]) -> Any:
    """Forward and backward over one step's micro-batches, each in forward
    passes of at most loop.micro_tokens tokens; answers the step's loss as a tensor
    (still on the card: reading it would wait for the card)."""
    n = len(micro)
    total = None
    for b in micro:
        rows = pass_rows(loop.micro_tokens, int(b.input_ids.shape[1]), len(b.input_ids))
        for part in split_batch(b, rows):
            with loop.autocast():
                # The mean per answer token of each micro-batch, as a causal
                # LM's own loss: a part's sum over the whole micro-batch's count.
                loss = answer_loss(loop.model, part, loop.loss_kernel) / (
                    max(b.answer_tokens, 1) * n
                )
            if loop.scaler is not None:
                loop.scaler.scale(loss).backward()
            else:
                loss.backward()
            d = loss.detach()
            total = d if total is None else total + d
    if total is None:
        raise TrainingFailureError("a step with no micro-batch: the data plan is empty")
    return total


def _step_passes(loop: Loop, step: int, micro: list[Batch]) -> Any | None:
    """A step's forward and backward passes (its loss, as _accumulate), or
    None when they ran out of the card's budget and the guard tightened the
    plan: the step is to be done again (the optimizer has not stepped, its
    gradients are dropped), at most once a plan, and plans only tighten."""
    objective = loop.objective
    try:
        return _accumulate(loop, micro) if objective is None else objective.accumulate(loop, micro)
    except Exception as e:
        if not is_out_of_memory(e) or loop.guard is None:
            raise
        if not loop.guard.out_of_memory(step, str(e)):
            raise
    # Out of the except block: its traceback's frames, and the activations
    # they held, are gone before the cache is given back.
    loop.optimizer.zero_grad(set_to_none=True)
    release_card_cache(loop.device)
    return None


def _optimizer_step(loop: Loop) -> None:
    if loop.scaler is not None:
        loop.scaler.step(loop.optimizer)
        loop.scaler.update()
    else:
        loop.optimizer.step()
    loop.scheduler.step()
    loop.optimizer.zero_grad(set_to_none=True)


def train_steps(
    loop: Loop,
    steps_plan: Iterator[tuple[int, list[Batch]]],
    total_steps: int,
    progress: Progress,
    on_step: Callable[[dict[str, Any]], None],
) -> None:
    """Run optimizer steps from `steps_plan` ((epoch, micro-batches) per step).

    The only host sync per step is the loss's .item(), after the optimizer step
    and after the next step's batches are made (they overlap the card's work).
    A step's time runs from the end of the one before, so that making its
    batches and reporting count too (tokens/s is what the job really gets),
    a pause to yield to the engine's users (`loop.gate`) does not.
    """
    t0 = time.perf_counter()
    upcoming = next(steps_plan, None)
    while upcoming is not None:
        if loop.gate is not None:
            t0 += loop.gate.wait(progress.step)  # a pause is not the next step's time
        epoch, micro = upcoming
        lr = loop.scheduler.get_last_lr()[0]
        if loop.guard is not None:
            loop.guard.before_step(progress.step + 1, micro)
        total = _step_passes(loop, progress.step + 1, micro)
        if total is None:
            continue  # ran out of the card's budget: the same step, under a tighter plan
        _optimizer_step(loop)
        # On a card all of the above is only queued: make the next step's
        # batches now, while it runs, then wait for the loss.
        upcoming = next(steps_plan, None)
        step_loss = float(total.item())
        if loop.guard is not None:
            loop.guard.after_step()
        if not math.isfinite(step_loss):
            raise TrainingFailureError(
                f"the loss became {step_loss} at step {progress.step + 1}; "
                "lower learning_rate, or train in bf16 or fp32"
            )
        now = time.perf_counter()
        dt, t0 = now - t0, now
        tokens = sum(b.tokens for b in micro)
        progress.step += 1
        progress.tokens += tokens
        progress.padding += sum(b.padding for b in micro)
        progress.train_s += dt
        progress.last_loss = step_loss
        on_step(
            {
                "step": progress.step,
                "steps": total_steps,
                "loss": step_loss,
                "learning_rate": float(lr),
                "tokens_per_s": round(tokens / dt, 1) if dt > 0 else 0.0,
                "eta_s": round(progress.train_s / progress.step * (total_steps - progress.step), 2),
                "peak_mib": peak_mib(loop),
                "epoch": epoch,
                **({} if loop.objective is None else loop.objective.step_metrics()),
            }
        )


def eval_loss(loop: Loop, batches: Sequence[Batch]) -> float:
    """Mean cross-entropy per answer token over `batches` (dropout off)."""
    import torch

    model = loop.model
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=loop.device)
    count = 0
    with torch.no_grad():
        for b in batches:
            with loop.autocast():
                total += answer_loss(model, b, loop.loss_kernel).double()
            count += b.answer_tokens
    model.train()
    return float(total.item()) / max(count, 1)


def resolve_dtype(requested: str, device: str) -> str:
    """The dtype to train in ("bf16", "fp16" or "fp32") on `device` ("cpu" or "cuda").

    BadInputError when the device cannot train so. On the CPU this needs no
    torch (it runs before anything is loaded).
    """
    if device == "cpu":
        if requested == "fp16":
            raise BadInputError(
                'params.dtype "fp16" needs a card; on the CPU use "fp32", "bf16" or "auto"'
            )
        return "fp32" if requested == "auto" else requested
    import torch

    bf16_ok = bool(torch.cuda.is_bf16_supported())
    if requested == "auto":
        return "bf16" if bf16_ok else "fp16"
    if requested == "bf16" and not bf16_ok:
        raise BadInputError(
            'params.dtype "bf16" is not supported by this card; use "fp16", "fp32" or "auto"'
        )
    return requested


def torch_dtype(name: str) -> Any:
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def enable_checkpointing(model: Any, every: int) -> None:
    """Gradient checkpointing of every `every`-th decoder layer from the first
    (0: none; lorafleet_trainer.memory chooses it), before or after peft
    wraps `model` (a tightened memory plan). transformers turns it on for
    every layer; the flag of those between is turned off again (newer
    transformers' every_n_layers does the same, which 4.57 lacks)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if every == 0:
        for layer in layers:
            layer.gradient_checkpointing = False
        return
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    kwargs = {"use_reentrant": False}
    if hasattr(base, "activation_checkpointing_enable"):  # its name since transformers 5.2x
        base.activation_checkpointing_enable(kwargs)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    base.enable_input_require_grads()
    base.config.use_cache = False
    for i, layer in enumerate(layers):
        layer.gradient_checkpointing = i % every == 0


def prepare_training(
    model: Any, params: Params, dtype: str, device: Any, total_steps: int, checkpoint_every: int = 0
) -> Loop:
    """Wrap `model` with LoRA (peft) and build the optimizer, scheduler and
    autocast; checkpoint_every: gradient checkpointing of every so many
    decoder layers (0: none)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import get_scheduler

    enable_checkpointing(model, checkpoint_every)
    config = LoraConfig(
        r=params.rank,
        # peft annotates an int, but scales by alpha / r: a float alpha is fine.
        lora_alpha=cast(Any, params.alpha),
        lora_dropout=params.dropout,
        target_modules=params.target_modules,
        task_type="CAUSAL_LM",
    )
    # peft keeps the adapter's weights in fp32 under a bf16/fp16 base
    # (autocast_adapter_dtype), which is what lets fp16 gradients be unscaled.
    model = get_peft_model(model, config)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=params.learning_rate)
    sched = get_scheduler(
        params.lr_scheduler,
        optimizer=opt,
        num_warmup_steps=params.warmup_steps,
        num_training_steps=total_steps,
    )
    scaler = torch.amp.GradScaler("cuda") if dtype == "fp16" else None
    if dtype == "fp32":

        def autocast() -> contextlib.AbstractContextManager[Any]:
            return contextlib.nullcontext()

    else:
        amp = torch_dtype(dtype)

        def autocast() -> contextlib.AbstractContextManager[Any]:
            return torch.autocast(device_type=device.type, dtype=amp)

    guard = MemoryGuard(None, None, Plan(checkpoint_every), PeakMeter(device))
    return Loop(model, opt, sched, scaler, autocast, device, kernel_name(device), guard=guard)


def plan_total_steps(tokens: Tokens, train: Sequence[int], p: Params) -> int:
    """The job's optimizer steps: max_steps, else epochs of the records with an
    answer token (which tokenizes them all: the count needs every length)."""
    if p.max_steps > 0:
        return p.max_steps
    kept = sum(1 for n in tokens.lengths(train) if n > 0)
    if not kept:
        raise BadInputError(NO_ANSWER.format(p.max_seq_len))
    per_epoch = math.ceil(math.ceil(kept / p.batch_size) / p.gradient_accumulation)
    return per_epoch * p.epochs


NO_ANSWER = "no record has an answer token within max_seq_len {}; raise it"


def eval_batches_of(
    tokens: Tokens, held: Sequence[int], p: Params, pad_id: int, device: Any
) -> list[Batch]:
    """The held-out records in length-sorted batches (the loss is a sum per
    token: their order does not change it, and sorting spares the padding)."""
    kept = sorted((e for e in tokens.get(held) if e.answer_tokens), key=lambda e: len(e.input_ids))
    return [
        to_batch(kept[i : i + p.batch_size], pad_id, device)
        for i in range(0, len(kept), p.batch_size)
    ]


def epoch_plan(
    train: Sequence[int],
    p: Params,
    epoch: int,
    lengths_of: Callable[[Sequence[int]], list[int]],
    steps_left: int,
    done: int,
) -> list[list[list[int]]]:
    """`epoch`'s steps, planned with the steps left when it began; BadInputError
    when there are none, or fewer than a resumed run's position says were done."""
    plan = plan_grouped(
        train, p.batch_size, p.gradient_accumulation, p.seed + epoch, lengths_of, steps_left
    )
    if not plan:
        raise BadInputError(NO_ANSWER.format(p.max_seq_len))
    if done > len(plan):
        raise BadInputError(
            f"the checkpoint's position, step {done} of epoch {epoch}, is past that "
            f"epoch's {len(plan)} steps: the data is not the checkpoint's"
        )
    return plan


#: Called after each optimizer step with the loop, the progress, the epoch
#: and the steps done of that epoch's plan.
AfterStep = Callable[[Loop, Progress, int, int], None]


@dataclasses.dataclass
class Start:
    """Where training starts: `index` steps into `epoch`'s plan, with the
    progress made by then (a fresh job: epoch 1, index 0)."""

    progress: Progress = dataclasses.field(default_factory=lambda: Progress())
    epoch: int = 1
    index: int = 0


def train_epochs(
    loop: Loop,
    tokens: Tokens,
    split: tuple[list[int], list[int]],
    p: Params,
    total_steps: int,
    pad_id: int,
    lines: LineWriter,
    start: Start | None = None,
    after_step: AfterStep | None = None,
) -> tuple[Progress, int]:
    """Epochs of length-grouped batches until total_steps, an eval after each
    (and so at the end), `after_step` after each step (the checkpointer's);
    answers the progress and the epochs run.

    An epoch's plan depends only on the seed, the epoch and the steps left
    when it began (max_steps cuts the last one short): a resumed run rebuilds
    its plan the same way and skips the steps done.
    """
    device = loop.device
    eval_batches: list[Batch] | None = None
    start = start or Start()
    progress, epoch, skip = start.progress, start.epoch - 1, start.index

    def steps_of(plan: list[list[list[int]]], epoch: int) -> Iterator[tuple[int, list[Batch]]]:
        for step in plan:
            yield epoch, [to_batch(tokens.get(mb), pad_id, device) for mb in step]

    while progress.step < total_steps:
        epoch += 1
        epoch_start = progress.step - skip
        plan = epoch_plan(split[0], p, epoch, tokens.lengths, total_steps - epoch_start, skip)

        def on_step(s: dict[str, Any], epoch: int = epoch, epoch_start: int = epoch_start) -> None:
            lines.emit(Event.STEP, **s)
            if after_step is not None:
                after_step(loop, progress, epoch, progress.step - epoch_start)

        train_steps(loop, steps_of(plan[skip:], epoch), total_steps, progress, on_step)
        skip = 0
        if split[1] and loop.objective is not None:
            found = loop.objective.evaluate(loop, tokens, split[1], p)
            progress.last_eval = found["eval_loss"]
            lines.emit(Event.EVAL, step=progress.step, epoch=epoch, **found)
        elif split[1]:
            if eval_batches is None:
                eval_batches = eval_batches_of(tokens, split[1], p, pad_id, device)
            if eval_batches:
                progress.last_eval = eval_loss(loop, eval_batches)
                lines.emit(
                    Event.EVAL, step=progress.step, epoch=epoch, eval_loss=progress.last_eval
                )
    return progress, epoch
