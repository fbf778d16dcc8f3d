"""PEFT's log-probabilities of a fixed prompt, the reference a served adapter
is checked against. A standalone program (torch, transformers, peft; nothing
of lorafleet), run in the engine's Python with its overlay:

    python peft_probe.py BASE_DIR ADAPTER_DIR [TEXT]

prints one JSON object: `token_ids` (TEXT tokenized by the base's tokenizer,
its special tokens included), then `adapter` and `base`, each the greedy
continuation of PROBE_TOKENS tokens (`ids`, end of sequence ignored) and the
log-probability of each (`logprobs`), by the adapted model and by the base
with the adapter disabled. float32 on the CPU: the same numbers on every
node, whatever card the engine uses.

Why a continuation and not the prompt's own log-probabilities: vLLM 0.32's
prompt logprobs for a LoRA request batched with other requests crash its
engine (the LoRA logits path gets the whole batch's indices: "einsum():
subscript b has size 5 ... does not broadcast"); sampled-token logprobs take
the ordinary path.
"""

from __future__ import annotations

import json
import sys
from typing import Any

PROBE_TEXT = "What is the capital of France? The capital of France is Paris."
PROBE_TOKENS = 8


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
    with torch.no_grad():
        adapter = _greedy(adapted, token_ids)
        with adapted.disable_adapter():
            base = _greedy(adapted, token_ids)
    print(json.dumps({"token_ids": token_ids, "adapter": adapter, "base": base}))
    return 0


def _greedy(model: Any, token_ids: list[int]) -> dict[str, list[Any]]:
    import torch

    ids, logprobs = list(token_ids), []
    for _ in range(PROBE_TOKENS):
        last = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
        token = int(torch.argmax(last))
        ids.append(token)
        logprobs.append(float(last[token]))
    return {"ids": ids[len(token_ids) :], "logprobs": logprobs}


if __name__ == "__main__":
    sys.exit(main(sys.argv))
