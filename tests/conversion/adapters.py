"""Real PEFT LoRA adapters on the tiny models, without the trainer, and the
tiny Llama's base prepared for llama.cpp's convert_hf_to_gguf.py."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

#: The adapted modules (PEFT names) and their GGUF tensor names.
TARGETS: dict[str, str] = {
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "o_proj": "attn_output",
    "gate_proj": "ffn_gate",
    "up_proj": "ffn_up",
    "down_proj": "ffn_down",
}
RANK = 4
ALPHA = 8
#: Standard deviation of the random lora_B weights (PEFT starts B at zero,
#: which would make an adapter that does nothing).
LORA_B_STD = 0.1


def make_adapter(base_dir: Path, out_dir: Path, *, seed: int = 1) -> Path:
    """A rank-RANK LoRA (alpha ALPHA) on every TARGETS module of the model in
    `base_dir`, with non-zero random lora_B, saved as safetensors in
    `out_dir`. Deterministic for a seed; leaves the global random state alone."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=RANK,
        lora_alpha=ALPHA,
        lora_dropout=0.0,
        target_modules=list(TARGETS),
        task_type="CAUSAL_LM",
    )
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # peft 0.21.2 calls a transformers API that transformers deprecates.
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated")
        torch.manual_seed(seed)
        peft_model: Any = get_peft_model(model, config)
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, LORA_B_STD)
    peft_model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def llama_style_tokenizer(vocab_size: int) -> dict[str, Any]:
    """A SentencePiece-like BPE tokenizer.json (byte fallback, "▁" for space)
    of exactly `vocab_size` tokens: `<unk>`, `<s>`, `</s>`, the 256 byte
    tokens, then single characters. convert_hf_to_gguf.py converts it as a
    "llama" vocabulary without a pre-tokenizer hash (which only known
    upstream vocabularies have)."""
    vocab: dict[str, int] = {}
    for tok in ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]:
        vocab[tok] = len(vocab)
    extra = ["▁"] + [chr(c) for c in range(33, 127)] + [chr(c) for c in range(0xC0, 0x250)]
    for ch in extra:
        if len(vocab) >= vocab_size:
            break
        vocab.setdefault(ch, len(vocab))
    if len(vocab) != vocab_size:
        raise ValueError(f"cannot fill a vocabulary of {vocab_size} tokens")
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": t,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for i, t in enumerate(["<unk>", "<s>", "</s>"])
        ],
        "normalizer": {
            "type": "Sequence",
            "normalizers": [
                {"type": "Prepend", "prepend": "▁"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
            ],
        },
        "pre_tokenizer": None,
        "post_processor": None,
        "decoder": {
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0},
            ],
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": "<unk>",
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": True,
            "byte_fallback": True,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [],
        },
    }


def base_for_gguf(base_dir: Path, out_dir: Path) -> Path:
    """`base_dir`'s config and weights with a llama-style tokenizer of the
    same size: the tiny models' byte-level BPE has a pre-tokenizer hash no
    llama.cpp release knows, and the parity check feeds token ids to
    llama.cpp directly, so the tokenizer only has to convert."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        if (base_dir / name).is_file():
            shutil.copy2(base_dir / name, out_dir / name)
    vocab_size = int(json.loads((base_dir / "config.json").read_text())["vocab_size"])
    (out_dir / "tokenizer.json").write_text(json.dumps(llama_style_tokenizer(vocab_size)))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "add_bos_token": True,
                "add_eos_token": False,
            }
        )
    )
    return out_dir
