"""Real PEFT LoRA adapters on the tiny models, without the trainer, and the
tiny Llama's base prepared for llama.cpp's convert_hf_to_gguf.py."""

from __future__ import annotations

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


def make_adapter(
    base_dir: Path, out_dir: Path, *, seed: int = 1, rank: int = RANK, probe: bool = False
) -> Path:
    """A rank-`rank` LoRA (alpha ALPHA; default rank RANK) on every TARGETS module of the model in
    `base_dir`, with non-zero random lora_B, saved as safetensors in
    `out_dir`. Deterministic for a seed; leaves the global random state alone.
    `probe`: also the PEFT probe reference (probe.json), as the trainer writes it."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
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
    if probe:
        from lorafleet_trainer.probe import write_probe

        assert write_probe(peft_model, base_dir, out_dir, "fp32") is None
    return out_dir


#: Pieces of the SentencePiece tokenizer the parity bases get (the 256 byte
#: pieces, the meta pieces and the text's characters need about 320).
SPM_VOCAB = 340


def _sentencepiece_model() -> bytes:
    import io

    import sentencepiece as spm

    from lorafleet_services.local.tiny_model import TOKENIZER_TEXT

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TOKENIZER_TEXT * 4),
        model_writer=buf,
        vocab_size=SPM_VOCAB,
        model_type="bpe",
        byte_fallback=True,
        num_threads=1,
        minloglevel=2,
    )
    return buf.getvalue()


def base_for_gguf(base_dir: Path, out_dir: Path) -> Path:
    """`base_dir`'s config and weights with a SentencePiece tokenizer
    (`tokenizer.model`, SPM_VOCAB pieces; the converter pads the vocabulary
    to the model's size). The tiny models' byte-level BPE has a pre-tokenizer
    hash no llama.cpp release knows, and the parity check feeds token ids to
    llama.cpp directly, so the tokenizer only has to convert."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        if (base_dir / name).is_file():
            shutil.copy2(base_dir / name, out_dir / name)
    (out_dir / "tokenizer.model").write_bytes(_sentencepiece_model())
    return out_dir
