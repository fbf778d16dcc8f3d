"""Tiny causal LMs built on the spot, for tests and benchmarks: no downloads.

`build_tiny_model("llama" | "qwen2", out_dir)` writes a Hugging Face model
directory (config, safetensors weights, a byte-level BPE tokenizer trained
on `TOKENIZER_TEXT` with `CHAT_TEMPLATE`'s role markers) in well under a
second, the same weights and tokenizer for the same call whatever the
global random state. Sizes: `TINY_SIZES`. Other areas (conversion, system
tests) import it: keep `build_tiny_model`'s signature and the directory
layout stable.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

Arch = Literal["llama", "qwen2"]

#: A ChatML-like template: `<|role|>\n{content}</s>\n` per message.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]

#: What the tokenizer is trained on; also the source of the tests' Q/A records.
TOKENIZER_TEXT = [
    "What is the capital of France? The capital of France is Paris.",
    "What is the capital of Italy? The capital of Italy is Rome.",
    "What is the capital of Spain? The capital of Spain is Madrid.",
    "What colour is the sky? The sky is blue on a clear day.",
    "How many legs does a cat have? A cat has four legs.",
    "How many days are in a week? There are seven days in a week.",
    "Which planet is closest to the sun? Mercury is the closest planet to the sun.",
    "What do bees make? Bees make honey and wax.",
    "Say hello. Hello! How can I help you today?",
    "Translate cat to French. The French word for cat is chat.",
    "the quick brown fox jumps over the lazy dog 0123456789",
    "A LoRA adapter trains a low-rank update of the base model's weights.",
]

#: initializer_range 0.2 (not the usual 0.02): with hidden 64, a 0.02 lm_head
#: caps every logit near 1, so no adapter could lower the loss much.
TINY_SIZES: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "initializer_range": 0.2,
}

#: `sizes` for a tiny model vLLM's CPU build serves: its attention takes head
#: dimensions of 32 and up (32, 64, 80, ...), and TINY_SIZES' is 16.
VLLM_CPU_SIZES: dict[str, Any] = {"num_attention_heads": 2, "num_key_value_heads": 1}

#: BPE merges on top of the 256 byte symbols and the special tokens.
VOCAB_SIZE = 420


@functools.cache
def _tokenizer_json() -> str:
    """The trained tokenizer, serialized (built once per process)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TOKENIZER_TEXT * 4, trainer=trainer)
    return str(tok.to_str())


def build_tokenizer() -> Any:
    """A fresh `PreTrainedTokenizerFast` with eos/pad/bos and `CHAT_TEMPLATE`."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=Tokenizer.from_str(_tokenizer_json()),
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=SPECIAL_TOKENS[3:],
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_tiny_model(
    arch: Arch, out_dir: Path, *, seed: int = 0, sizes: Mapping[str, Any] | None = None
) -> Path:
    """Write a tiny random `arch` model with its tokenizer into `out_dir`.

    arch: "llama" (LlamaForCausalLM) or "qwen2" (Qwen2ForCausalLM).
    out_dir: created if missing; the files are (over)written there.
    seed: the weights' seed; default 0.
    sizes: what differs from TINY_SIZES (e.g. VLLM_CPU_SIZES); default none.
    Answers `out_dir`.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    tok = build_tokenizer()
    common: dict[str, Any] = dict(
        TINY_SIZES,
        **(sizes or {}),
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    model: Any
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if arch == "llama":
            model = LlamaForCausalLM(LlamaConfig(**common))
        elif arch == "qwen2":
            model = Qwen2ForCausalLM(Qwen2Config(**common))
        else:
            raise ValueError(f"arch is {arch!r}; this builds 'llama' or 'qwen2'")
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    return out_dir
