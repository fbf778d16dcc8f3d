"""The real bytes of one LoRA training step on the CPU, as the estimate's lines.

`measure_step(model, params, batch_rows, checkpoint_every)` wraps `model` with
the trainer's own `prepare_training` (peft LoRA, AdamW, gradient checkpointing
of every `checkpoint_every`-th layer) and runs one optimizer step of its loss
(`answer_loss`) on a micro-batch of `batch_rows` (equal-length token lists),
answering the bytes of
the base weights, the adapter, its gradients, the optimizer's states (each
summed over the real tensors) and the activations: the peak of torch's CPU
allocations during the forward and backward pass (the profiler's memory
events, every allocation and free in order), less the gradients made then.
"""

from __future__ import annotations

import warnings
from typing import Any

from lorafleet_trainer.batches import to_batch
from lorafleet_trainer.loop import prepare_training
from lorafleet_trainer.loss import answer_loss
from lorafleet_trainer.rendering import IGNORE, Encoded


def _bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def peak_allocated(fn: Any) -> int:
    """The peak of CPU bytes allocated (net of frees) while `fn()` runs."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    current = peak = 0
    for e in events:
        current += e.nbytes()
        peak = max(peak, current)
    return peak


def measure_step(
    model: Any, params: Any, rows: list[list[int]], checkpoint_every: int
) -> dict[str, int]:
    import torch

    cpu = torch.device("cpu")
    base = _bytes(model.parameters())
    with warnings.catch_warnings():
        # peft 0.21 still calls transformers' deprecated is_gradient_checkpointing.
        warnings.simplefilter("ignore", FutureWarning)
        loop = prepare_training(model, params, "fp32", cpu, 10, checkpoint_every)
    trainable = [p for p in loop.model.parameters() if p.requires_grad]
    # The first quarter of each row is its prompt: no loss there.
    encoded = [Encoded(r, [IGNORE] * (len(r) // 4) + r[len(r) // 4 :], cut=False) for r in rows]
    batch = to_batch(encoded, 0, cpu)

    def forward_backward() -> None:
        # As the trainer's step: the mean over the answer tokens.
        (answer_loss(loop.model, batch) / batch.answer_tokens).backward()

    peak = peak_allocated(forward_backward)
    grads = _bytes(p.grad for p in trainable)
    loop.optimizer.step()
    states = _bytes(
        t for s in loop.optimizer.state.values() for t in s.values() if torch.is_tensor(t)
    )
    return {
        "weights": base,
        "adapter": _bytes(trainable),
        "gradients": grads,
        "optimizer states": states,
        "activations": peak - grads,
    }
