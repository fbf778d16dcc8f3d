"""PEFT's log-probabilities of a fixed prompt, the reference a served adapter
is checked against. A standalone program (torch, transformers, peft; nothing
of lorafleet), run in the engine's Python with its overlay:

    python peft_probe.py BASE_DIR ADAPTER_DIR [TEXT]

prints one JSON object: `token_ids` (TEXT tokenized by the base's tokenizer,
its special tokens included), `adapter` and `base` (for each token after the
first, the log-probability the adapted model, and the base with the adapter
disabled, gives it after the tokens before it). float32 on the CPU: the same
numbers on every node, whatever card the engine uses.
"""

from __future__ import annotations

import json
import sys
from typing import Any

PROBE_TEXT = "What is the capital of France? The capital of France is Paris."


def main(argv: list[str]) -> int:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if len(argv) not in (3, 4):
        print(__doc__, file=sys.stderr)
        return 2
    base_dir, adapter_dir = argv[1], argv[2]
    text = argv[3] if len(argv) == 4 else PROBE_TEXT
    token_ids = list(AutoTokenizer.from_pretrained(base_dir)(text)["input_ids"])
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    adapted = PeftModel.from_pretrained(model, adapter_dir).eval()
    inputs = torch.tensor([token_ids])
    with torch.no_grad():
        adapter = _token_logprobs(adapted(inputs).logits, inputs)
        with adapted.disable_adapter():
            base = _token_logprobs(adapted(inputs).logits, inputs)
    print(json.dumps({"token_ids": token_ids, "adapter": adapter, "base": base}))
    return 0


def _token_logprobs(logits: Any, inputs: Any) -> list[float]:
    import torch

    logprobs = torch.log_softmax(logits[0, :-1].float(), dim=-1)
    picked = logprobs.gather(1, inputs[0, 1:].unsqueeze(1)).squeeze(1)
    return [float(v) for v in picked]


if __name__ == "__main__":
    sys.exit(main(sys.argv))
