"""What the memory plan's tests (test_memory.py, test_guard.py) share: the
bench's model shapes (bench/trainer_trl.py), the CPU device, a tiny random
Llama to train for real, and the mark for peft's deprecation warning."""

from __future__ import annotations

from typing import Any

import pytest

from lorafleet_trainer import memory

# peft 0.21 still calls transformers' deprecated is_gradient_checkpointing.
PEFT_DEPRECATION = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")


def bench_arch(vocab_size: int) -> memory.Architecture:
    """bench/trainer_trl.py's model (hidden 512, 10 layers) with `vocab_size`
    tokens: 32,000 is a small vocabulary, 152,064 Qwen2's."""
    return memory.Architecture(
        num_hidden_layers=10,
        hidden_size=512,
        intermediate_size=1376,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=vocab_size,
    )


def cpu() -> Any:
    import torch

    return torch.device("cpu")


def tiny_llama(layers: int) -> Any:
    """A Llama of `layers` layers, hidden 32 and 64 tokens, its weights from seed 0."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    return LlamaForCausalLM(config)
