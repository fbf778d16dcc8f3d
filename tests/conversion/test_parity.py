"""Parity: the GGUF adapter applied by llama.cpp b11312 gives the logits that
PEFT gives in transformers.

llama.cpp's library is built once from the same source (CPU only, cached
under the test cache, see llamacpp_source.py); each tiny base (Llama, Qwen2) goes to
GGUF with that release's convert_hf_to_gguf.py (f32, so the only rounding
left is the adapter's f16); a small C shim (llama_eval.c) loads base +
adapter and evaluates token ids, called through ctypes.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lorafleet_services.agent.config import AgentConfig
from tests.conversion import llamacpp_source
from tests.conversion.adapters import base_for_gguf
from tests.conversion.conftest import ARCHES, Converted, Tiny

PROMPTS = [
    "What is the capital of France?",
    "How many legs does a cat have? A cat has",
    "the quick brown fox",
    "Translate cat to French.",
]
#: Largest difference allowed between llama.cpp's and PEFT's logits.
MAX_DIFF = 1e-2
#: Smallest change the adapter must make to the logits, for the check to mean anything.
MIN_ADAPTER_EFFECT = 0.1


def _llamacpp(lib: Any, model: Path, adapter: Path | None, tokens: list[int]) -> np.ndarray:
    ids = (ctypes.c_int32 * len(tokens))(*tokens)
    out = np.zeros(len(tokens) * 4096, dtype=np.float32)
    n_vocab = lib.lf_eval(
        str(model).encode(),
        None if adapter is None else str(adapter).encode(),
        ctypes.c_float(1.0),
        ids,
        len(tokens),
        out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
        out.size,
    )
    assert n_vocab > 0, f"lf_eval failed with {n_vocab} (see llama_eval.c)"
    return out[: len(tokens) * n_vocab].reshape(len(tokens), n_vocab)


def _load_shim() -> Any:
    lib = ctypes.CDLL(str(llamacpp_source.shim_library()))
    lib.lf_eval.restype = ctypes.c_int
    lib.lf_eval.argtypes = [
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_float,
        ctypes.POINTER(ctypes.c_int32),
        ctypes.c_int32,
        ctypes.POINTER(ctypes.c_float),
        ctypes.c_int64,
    ]
    return lib


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the first run builds llama.cpp (minutes on 2 shared cores)
@pytest.mark.parametrize("arch", ARCHES)
def test_llamacpp_with_the_gguf_adapter_matches_peft(
    arch: str,
    converted: dict[str, Converted],
    tiny: dict[str, Tiny],
    fetched: AgentConfig,
    tmp_path: Path,
) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    lib = _load_shim()
    code = fetched.work_dir / f"llama.cpp-{llamacpp_source.TAG}"
    base_gguf = tmp_path / "base-f32.gguf"
    env = {**os.environ, "PYTHONPATH": f"{code / 'gguf-py'}:{code}", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [
            sys.executable,
            str(code / "convert_hf_to_gguf.py"),
            "--outtype",
            "f32",
            "--outfile",
            str(base_gguf),
            str(base_for_gguf(tiny[arch].base, tmp_path / "base")),
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]

    tok = AutoTokenizer.from_pretrained(tiny[arch].base)
    prompts = [[tok.bos_token_id, *tok(p, add_special_tokens=False)["input_ids"]] for p in PROMPTS]
    model = AutoModelForCausalLM.from_pretrained(tiny[arch].base, dtype=torch.float32)
    with torch.no_grad():
        hf_base = [model(torch.tensor([ids])).logits[0].numpy() for ids in prompts]
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated")
            peft_model = PeftModel.from_pretrained(model, tiny[arch].adapter)
        hf_lora = [peft_model(torch.tensor([ids])).logits[0].numpy() for ids in prompts]

    adapter = converted[arch].gguf
    base_diff = lora_diff = effect = 0.0
    for ids, want_base, want_lora in zip(prompts, hf_base, hf_lora, strict=True):
        got_base = _llamacpp(lib, base_gguf, None, ids)
        got_lora = _llamacpp(lib, base_gguf, adapter, ids)
        base_diff = max(base_diff, float(np.abs(got_base - want_base).max()))
        lora_diff = max(lora_diff, float(np.abs(got_lora - want_lora).max()))
        effect = max(effect, float(np.abs(want_lora - want_base).max()))
    print(
        f"max |logit diff|: base {base_diff:.2e}, base+adapter {lora_diff:.2e}; "
        f"the adapter moves logits by up to {effect:.2f}"
    )
    assert effect > MIN_ADAPTER_EFFECT
    assert base_diff <= MAX_DIFF
    assert lora_diff <= MAX_DIFF
