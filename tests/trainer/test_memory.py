"""The checkpointing choice (lorafleet_trainer.memory) and its application
to the model's layers (lorafleet_trainer.loop.enable_checkpointing)."""

from __future__ import annotations

import dataclasses

import pytest

from lorafleet_trainer import memory
from lorafleet_trainer.loop import prepare_training
from lorafleet_trainer.params import Params

# peft 0.21 still calls transformers' deprecated is_gradient_checkpointing.
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")

ARCH = memory.Architecture(
    num_hidden_layers=10,
    hidden_size=512,
    intermediate_size=1376,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=152_064,
)
PARAMS = Params(batch_size=8, max_seq_len=512, dtype="bf16")


def _mib(every: int) -> int:
    lines = memory.estimate_lines(ARCH, PARAMS, "cuda", 512, every)
    return -(-sum(b for _, b, _ in lines) // memory.MIB)


def test_auto_takes_the_least_checkpointing_that_fits() -> None:
    none, every_5th, every = _mib(0), _mib(5), _mib(1)
    assert none > every_5th > every
    choose = memory.choose_checkpointing
    assert choose(ARCH, PARAMS, "cuda", 512, None).every == 0
    assert choose(ARCH, PARAMS, "cuda", 512, none).every == 0
    # Every 10th (1 layer), 5th (2), 4th (3), ...: the first that fits.
    fit = choose(ARCH, PARAMS, "cuda", 512, every_5th)
    assert fit.every == 5 and fit.total_mib == every_5th
    assert fit.message == (
        f"gradient checkpointing every 5th layer (2 of 10): without it the estimate is {none} "
        f"MiB, over the budget of {every_5th} MiB; with it {every_5th} MiB, which fits it"
    )
    short = choose(ARCH, PARAMS, "cuda", 512, every - 1)
    assert short.every == 1 and "is the least, still over" in short.reason
    for fixed, want in ((True, 1), (False, 0)):
        p = dataclasses.replace(PARAMS, gradient_checkpointing=fixed)
        assert choose(ARCH, p, "cuda", 512, 1).every == want


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
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    model = LlamaForCausalLM(config)
    loop = prepare_training(model, Params(rank=2), "fp32", torch.device("cpu"), 1, every)
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
