"""PEFT's answer on a fixed prompt: the reference a served adapter is checked
against (the agent's adapter_serving confirms vLLM's answer against it).

One implementation (`probe_reference`), run two ways: by the trainer right
after it saves an fp32-trained adapter (written as PROBE_FILE into the
adapter directory, so it travels inside the PEFT artifact), and as this
program for adapters without one, in the engine's Python with its overlay:

    python -m lorafleet_trainer.probe BASE_DIR ADAPTER_DIR [TEXT]

The object: `text`, `dtype` ("float32"), `token_ids`, then `adapter` and
`base`: each the greedy continuation of PROBE_TOKENS tokens (`ids`) and
their log-probabilities (`logprobs`), with the adapter on and off. Why
float32 only, and why a continuation rather than the prompt's own
log-probabilities: trainer/DESIGN.md and docs/architecture.md. Standard library
at import; torch, transformers and peft when called.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

PROBE_TEXT = "What is the capital of France? The capital of France is Paris."
PROBE_TOKENS = 8
#: The file in the adapter directory that holds the trainer's reference.
PROBE_FILE = "probe.json"
#: The only dtype a reference is computed in (module docstring).
PROBE_DTYPE = "float32"


def probe_reference(model: Any, token_ids: list[int], text: str) -> dict[str, Any]:
    """The reference of the PEFT model `model` (a PeftModel, in float32) on
    `token_ids` (`text` tokenized by the base's tokenizer). Leaves the model
    in the train/eval mode it found it in."""
    import torch

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            adapter = _greedy(model, token_ids)
            with model.disable_adapter():
                base = _greedy(model, token_ids)
    finally:
        model.train(was_training)
    return {
        "text": text,
        "dtype": PROBE_DTYPE,
        "token_ids": token_ids,
        "adapter": adapter,
        "base": base,
    }


def _greedy(model: Any, token_ids: list[int]) -> dict[str, list[Any]]:
    import torch

    device = next(model.parameters()).device
    ids, logprobs = list(token_ids), []
    for _ in range(PROBE_TOKENS):
        logits = model(torch.tensor([ids], device=device)).logits[0, -1]
        last = torch.log_softmax(logits.float(), dim=-1)
        token = int(torch.argmax(last))
        ids.append(token)
        logprobs.append(float(last[token]))
    return {"ids": ids[len(token_ids) :], "logprobs": logprobs}


def probe_token_ids(base_dir: Path | str, text: str = PROBE_TEXT) -> list[int]:
    """`text` tokenized as the probe (and vLLM's check) tokenizes it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(base_dir), trust_remote_code=False)
    return list(tokenizer(text)["input_ids"])


def write_probe(model: Any, base_dir: Path, adapter_dir: Path, dtype: str) -> str | None:
    """The trainer's reference written into `adapter_dir` (PROBE_FILE, whole
    or not at all); `dtype`: what it trained in. None when written, else why
    not (the agent then runs the program)."""
    if dtype != "fp32":
        return (
            f"no {PROBE_FILE}: trained in {dtype}, the reference is {PROBE_DTYPE}; "
            "the serving agent computes it"
        )
    reference = probe_reference(model, probe_token_ids(base_dir), PROBE_TEXT)
    partial = adapter_dir / f".{PROBE_FILE}.partial"
    partial.write_text(json.dumps(reference) + "\n", encoding="utf-8")
    os.replace(partial, adapter_dir / PROBE_FILE)
    return None


def main(argv: list[str]) -> int:
    if len(argv) not in (3, 4):
        print(__doc__, file=sys.stderr)
        return 2
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base_dir, adapter_dir = argv[1], argv[2]
    text = argv[3] if len(argv) == 4 else PROBE_TEXT
    token_ids = probe_token_ids(base_dir, text)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    adapted = PeftModel.from_pretrained(model, adapter_dir)
    print(json.dumps(probe_reference(adapted, token_ids, text)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
