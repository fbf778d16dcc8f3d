"""The chunked loss against the plain one (the model's whole logits and
cross-entropy): the same loss and gradients, on the answer tokens only."""

from __future__ import annotations

from typing import Any

import pytest

from lorafleet_trainer.batches import to_batch
from lorafleet_trainer.loop import prepare_training
from lorafleet_trainer.loss import answer_loss, chunked_cross_entropy, fused_head
from lorafleet_trainer.params import Params
from lorafleet_trainer.rendering import IGNORE, Encoded

# peft 0.21 still calls transformers' deprecated is_gradient_checkpointing.
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")

SIZES = {
    "vocab_size": 301,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def _model(arch: str, tied: bool) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**SIZES, tie_word_embeddings=tied))
    return Qwen2ForCausalLM(Qwen2Config(**SIZES, tie_word_embeddings=tied))


def _encoded(seed: int, lengths: list[int]) -> list[Encoded]:
    import random

    rng = random.Random(seed)
    out = []
    for n in lengths:
        ids = [rng.randrange(1, SIZES["vocab_size"]) for _ in range(n)]
        prompt = n // 3
        labels = [IGNORE] * prompt + ids[prompt:]
        out.append(Encoded(input_ids=ids, labels=labels, cut=False))
    return out


def _plain(model: Any, batch: Any) -> Any:
    """The loss as the model computes it: whole logits, ignore_index, summed."""
    import torch.nn.functional as F

    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
        batch.labels[:, 1:].reshape(-1),
        ignore_index=IGNORE,
        reduction="sum",
    )


@pytest.mark.parametrize("rows", [1, 7, 10_000])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_chunks_give_the_plain_loss_and_gradients(rows: int, softcap: float | None) -> None:
    import torch
    import torch.nn.functional as F

    torch.manual_seed(1)
    hidden = torch.randn(23, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (23,))
    logits = hidden @ weight.T
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    want = F.cross_entropy(logits, targets, reduction="sum")
    want_grads = torch.autograd.grad(want * 0.7, (hidden, weight))
    got = chunked_cross_entropy(hidden, weight, targets, rows=rows, softcap=softcap)
    got_grads = torch.autograd.grad(got * 0.7, (hidden, weight))
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("arch", "tied"), [("llama", False), ("qwen2", True)])
def test_a_model_s_answer_loss_and_adapter_gradients_match_the_plain_ones(
    arch: str, tied: bool
) -> None:
    import torch

    model = _model(arch, tied)
    loop = prepare_training(model, Params(rank=4, dropout=0.0), "fp32", torch.device("cpu"), 10)
    batch = to_batch(_encoded(0, [9, 17, 12]), 0, torch.device("cpu"))
    trainable = [p for p in loop.model.parameters() if p.requires_grad]
    want = _plain(loop.model, batch)
    want_grads = torch.autograd.grad(want, trainable)
    got = answer_loss(loop.model, batch)
    got_grads = torch.autograd.grad(got, trainable)
    assert batch.answer_tokens == int((batch.labels[:, 1:] != IGNORE).sum()) == 26
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
    # Tied or not, the head is the projection the loss uses.
    head = fused_head(loop.model.get_base_model())
    assert head is not None and head[1] is None
    assert (head[0] is model.get_input_embeddings().weight) is tied


def test_under_bf16_autocast_the_loss_is_the_plain_one_within_its_precision() -> None:
    import torch

    model = _model("llama", False)
    loop = prepare_training(model, Params(rank=4), "bf16", torch.device("cpu"), 10)
    batch = to_batch(_encoded(2, [20, 20]), 0, torch.device("cpu"))
    loop.model.eval()
    with torch.no_grad(), loop.autocast():
        want, got = _plain(loop.model, batch), answer_loss(loop.model, batch)
    assert got.dtype == torch.float32
    assert got.item() == pytest.approx(want.item(), rel=1e-2)


def test_the_model_never_makes_the_whole_logits() -> None:
    import torch

    model = _model("llama", False)
    loop = prepare_training(model, Params(rank=4), "fp32", torch.device("cpu"), 10)
    batch = to_batch(_encoded(3, [30, 30]), 0, torch.device("cpu"))
    seen: list[Any] = []
    model.lm_head.register_forward_hook(lambda *a: seen.append(a))
    answer_loss(loop.model, batch).backward()
    assert seen == []
