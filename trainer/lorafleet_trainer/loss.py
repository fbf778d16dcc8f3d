"""The loss, without the whole logits: a batch's cross-entropy from the last
hidden state and the output projection (why: trainer/DESIGN.md).

`answer_loss(model, batch)` answers it summed over the answer tokens (the
loop divides by `Batch.answer_tokens`, as a causal LM's own loss does),
projecting only the answer positions, `chunk_rows(vocab)` at a time, their
logits recomputed in the backward pass: by cut-cross-entropy's or
liger-kernel's fused kernel on a card when importable, else by
`chunked_cross_entropy` in plain torch. A head that does more than a
bias-free projection and a soft-cap (`fused_head`) takes the model's own
logits.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from lorafleet_trainer.batches import Batch
from lorafleet_trainer.memory import chunk_rows

#: Config fields by which a head scales its logits beyond a soft-cap (Cohere,
#: Granite): such a model's loss comes from its own logits.
_LOGIT_SCALES = ("logit_scale", "logits_scaling")


def _chunked_function() -> Any:
    import torch

    class ChunkedLinearCrossEntropy(torch.autograd.Function):
        """sum over rows of cross_entropy(hidden @ weight.T, targets), one
        chunk of rows at a time; backward recomputes each chunk's logits."""

        @staticmethod
        def forward(
            ctx: Any, hidden: Any, weight: Any, targets: Any, rows: int, softcap: float | None
        ) -> Any:
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            for s in range(0, hidden.shape[0], rows):
                logits = _logits(hidden[s : s + rows], weight, softcap)[0]
                t = targets[s : s + rows]
                total += (
                    torch.logsumexp(logits, dim=-1) - logits.gather(1, t[:, None])[:, 0]
                ).sum()
            ctx.save_for_backward(hidden, weight, targets)
            ctx.rows, ctx.softcap = rows, softcap
            return total

        @staticmethod
        def backward(ctx: Any, grad_total: Any) -> Any:
            hidden, weight, targets = ctx.saved_tensors
            want_hidden, want_weight = ctx.needs_input_grad[:2]
            grad_hidden = torch.empty_like(hidden) if want_hidden else None
            grad_weight = torch.zeros_like(weight, dtype=torch.float32) if want_weight else None
            for s in range(0, hidden.shape[0], ctx.rows):
                h = hidden[s : s + ctx.rows]
                logits, capped = _logits(h, weight, ctx.softcap)
                g = torch.softmax(logits, dim=-1)
                g[torch.arange(g.shape[0], device=g.device), targets[s : s + ctx.rows]] -= 1
                g *= grad_total
                if capped is not None:
                    g *= 1 - capped * capped  # d(cap * tanh(x / cap)) / dx
                g = g.to(hidden.dtype)
                if grad_hidden is not None:
                    grad_hidden[s : s + ctx.rows] = g @ weight
                if grad_weight is not None:
                    grad_weight += (g.T @ h).float()
            if grad_weight is not None:
                grad_weight = grad_weight.to(weight.dtype)
            return grad_hidden, grad_weight, None, None, None

    def _logits(h: Any, weight: Any, softcap: float | None) -> tuple[Any, Any]:
        """A chunk's fp32 logits, and tanh of them over the cap when capped."""
        logits = (h @ weight.T).float()
        if softcap is None:
            return logits, None
        capped = torch.tanh(logits / softcap)
        return capped * softcap, capped

    return ChunkedLinearCrossEntropy


_FUNCTION: Any = None


def chunked_cross_entropy(
    hidden: Any, weight: Any, targets: Any, *, rows: int, softcap: float | None = None
) -> Any:
    """The summed cross-entropy of `hidden` (N, h) projected by `weight` (V, h)
    against `targets` (N,), with at most `rows` rows' logits alive at a time.
    The matmuls run in `hidden`'s dtype, the softmax in fp32 (as the model's
    own head and loss do under autocast)."""
    global _FUNCTION
    if _FUNCTION is None:
        _FUNCTION = _chunked_function()
    return _FUNCTION.apply(hidden, weight, targets, rows, softcap)


#: Each kernel library's fused linear cross-entropy: (module, function).
_KERNELS = {
    "cut-cross-entropy": ("cut_cross_entropy", "linear_cross_entropy"),
    "liger-kernel": ("liger_kernel.transformers.functional", "liger_fused_linear_cross_entropy"),
}


def kernel_name(device: Any) -> str:
    """The fused kernel the loss uses on `device`: "cut-cross-entropy",
    "liger-kernel" (on a card, when importable) or "torch"."""
    if device.type == "cuda":
        for name, (module, _) in _KERNELS.items():
            if importlib.util.find_spec(module.split(".")[0]) is not None:
                return name
    return "torch"


def _summed(kernel: str, hidden: Any, weight: Any, targets: Any, softcap: float | None) -> Any:
    if kernel in _KERNELS:
        module, name = _KERNELS[kernel]
        # Both take (hidden, weight, targets) and a softcap, and sum on request.
        fused = getattr(importlib.import_module(module), name)
        return fused(hidden, weight, targets, softcap=softcap, reduction="sum")
    rows = chunk_rows(weight.shape[0])
    return chunked_cross_entropy(hidden, weight, targets, rows=rows, softcap=softcap)


def fused_head(causal_lm: Any) -> tuple[Any, float | None] | None:
    """The output projection's weight and soft-cap of a causal LM whose head
    is only those (Llama, Qwen2, Mistral, Gemma 2: tied or not), else None."""
    import torch

    head = causal_lm.get_output_embeddings()
    config = causal_lm.config
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        return None
    if any(getattr(config, k, None) not in (None, 1, 1.0) for k in _LOGIT_SCALES):
        return None
    return head.weight, getattr(config, "final_logit_softcapping", None) or None


def answer_rows(model: Any, batch: Batch) -> tuple[Any, Any, float | None] | Any:
    """What the loss projects at `batch`'s answer positions: (hidden rows,
    head weight, soft-cap) in the head's matmul dtype, the matmul to be run
    with autocast off; or, for a head `fused_head` cannot take, the picked
    fp32 logits themselves (a tensor)."""
    import torch

    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = fused_head(causal_lm)
    if head is None:
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        flat = logits[:, :-1].reshape(-1, logits.shape[-1])
        return flat.index_select(0, batch.answer_positions).float()
    weight, softcap = head
    hidden = causal_lm.get_decoder()(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False
    ).last_hidden_state
    rows = hidden[:, :-1].reshape(-1, hidden.shape[-1]).index_select(0, batch.answer_positions)
    device = rows.device.type
    if torch.is_autocast_enabled(device):
        # The head's matmul in the autocast dtype, as the model's own lm_head's.
        dtype = torch.get_autocast_dtype(device)
        return rows.to(dtype), weight.to(dtype), softcap
    return rows.to(weight.dtype), weight, softcap


def answer_loss(model: Any, batch: Batch, kernel: str = "torch") -> Any:
    """The summed cross-entropy over `batch`'s answer tokens: a 0-dim fp32
    tensor, nothing read back from a card. `model`: the peft model (or the
    causal LM); its decoder gives the hidden states, and no logits are made
    beyond a chunk's."""
    import torch
    import torch.nn.functional as F

    found = answer_rows(model, batch)
    if not isinstance(found, tuple):
        return F.cross_entropy(found, batch.answer_targets, reduction="sum")
    rows, weight, softcap = found
    with torch.autocast(rows.device.type, enabled=False):
        return _summed(kernel, rows, weight, batch.answer_targets, softcap)
