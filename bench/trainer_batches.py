"""The trainer's batches and tokenizing against today's way, on the CPU, in one script.

    .venv/bin/python bench/trainer_batches.py [--records 46599] [--train-records 384]

Two parts, each a ratio against the old way measured here, in this process:

1. Time to the first step. A synthetic NDJSON dataset the size of the one in
   issue 14 (46,599 Q/A records, about 63 MB, rendered with the tiny model's
   chat template and tokenizer) is prepared as each way needs before step 1
   of a job with max_steps 5, batch_size 4:
   - before: every record rendered and tokenized one at a time
     (`encode_conversation`, as the old `encode_records` did);
   - after: `Tokens` + `plan_grouped` for the 5 steps (what `run` does);
   - after, whole file: every record through `encode_many` (a job without
     max_steps tokenizes everything, in batches).
2. Real tokens per second. The same Llama-shaped model (random weights, about
   3.5M parameters), the same LoRA, the same records (a long-tailed length
   distribution from 16 to 512 tokens, a learnable pattern) and the same
   epochs, trained with the trainer's `train_steps` twice: batches from
   `plan_steps` (shuffled, padded to the longest: the old way) and from
   `plan_grouped`. Reported: real (non-padding) tokens/s of each, their
   ratio, the padding share and the held-out loss of each after the epochs.

torch is held to one thread, the tokenizer to no parallelism: the figures
are steadier on a shared machine (a node's many cores would help both ways).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lorafleet_services.local.tiny_model import TOKENIZER_TEXT, build_tokenizer  # noqa: E402
from lorafleet_trainer import rendering  # noqa: E402
from lorafleet_trainer.batches import plan_grouped, plan_steps, split_records, to_batch  # noqa: E402
from lorafleet_trainer.loop import Progress, eval_loss, prepare_training, train_steps  # noqa: E402
from lorafleet_trainer.params import Params  # noqa: E402
from lorafleet_trainer.records import parse_record  # noqa: E402
from lorafleet_trainer.rendering import Encoded, Tokens, encode_conversation, encode_many  # noqa: E402

WORDS = " ".join(TOKENIZER_TEXT).replace("?", "").replace(".", "").split()


def synthetic_records(n: int, seed: int = 0) -> list[dict[str, str]]:
    """Q/A records of about 1,350 bytes on average (46,599 of them: about 63 MB)."""
    rng = random.Random(seed)

    def text(words: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(words))

    return [{"q": text(rng.randint(10, 90)), "a": text(rng.randint(50, 400))} for _ in range(n)]


def time_to_first_step(n_records: int) -> dict[str, Any]:
    tok = build_tokenizer()
    template = tok.chat_template
    lines = [json.dumps(r) for r in synthetic_records(n_records)]
    size_mb = sum(len(x) + 1 for x in lines) / 1e6
    numbered = [(i + 1, parse_record(x, i + 1)) for i, x in enumerate(lines)]
    train, _ = split_records(len(numbered), 0.1, 42)

    t0 = time.perf_counter()
    before = [encode_conversation(tok, template, conv, 1024) for _, conv in numbered]
    before_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    tokens = Tokens(tok, template, numbered, 1024)
    plan = plan_grouped(train, 4, 1, 43, tokens.lengths, 5)
    after_s = time.perf_counter() - t0
    assert len(plan) == 5

    t0 = time.perf_counter()
    whole = encode_many(tok, template, numbered, 1024)
    whole_s = time.perf_counter() - t0
    assert whole == before, "batched tokens differ from record-by-record ones"
    # The same on one thread: what batching alone gives, without the tokenizer's pool.
    # (A bench's counterfactual: the pool's switch replaced for this process.)
    rendering._parallel_tokenizing = contextlib.nullcontext  # TOKENIZERS_PARALLELISM stays false
    t0 = time.perf_counter()
    encode_many(tok, template, numbered, 1024)
    one_thread_s = time.perf_counter() - t0
    return {
        "records": n_records,
        "data_mb": round(size_mb, 1),
        "before_s": round(before_s, 2),
        "after_max_steps_5_s": round(after_s, 3),
        "records_tokenized_for_5_steps": tokens.done,
        "ratio_first_step": round(before_s / after_s, 1),
        "cores": os.cpu_count(),
        "after_whole_file_s": round(whole_s, 2),
        "ratio_whole_file": round(before_s / whole_s, 2),
        "after_whole_file_one_thread_s": round(one_thread_s, 2),
    }


def long_tail_records(n: int, vocab: int, seed: int) -> list[Any]:
    """Records of 16 to 512 tokens, most short; each an arithmetic run of token
    ids (learnable), the first quarter the prompt (no loss)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = min(512, 16 + int(rng.paretovariate(1.2) * 16))
        start, stride = rng.randrange(vocab), rng.randrange(1, 7)
        ids = [(start + k * stride) % vocab for k in range(length)]
        prompt = length // 4
        out.append(Encoded(ids, [-100] * prompt + ids[prompt:], False))
    return out


def throughput(n_train: int, epochs: int) -> dict[str, Any]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = 420
    records = long_tail_records(n_train + 64, vocab, seed=1)
    train, held = records[:n_train], records[n_train:]
    params = Params(rank=8, alpha=16, dropout=0.0, learning_rate=2e-3, batch_size=8)
    cpu = torch.device("cpu")
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    lengths = [len(e.input_ids) for e in train]
    eval_batches = [to_batch(held[i : i + 8], 0, cpu) for i in range(0, len(held), 8)]

    def plans(grouped: bool, epoch: int) -> list[list[list[int]]]:
        if grouped:
            return plan_grouped(range(n_train), 8, 1, epoch, lambda ids: [lengths[i] for i in ids])
        return plan_steps(n_train, 8, 1, epoch)

    def run(grouped: bool) -> dict[str, Any]:
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        steps = sum(len(plans(grouped, e)) for e in range(1, epochs + 1))
        loop = prepare_training(model, params, "fp32", cpu, steps)
        progress = Progress()
        for e in range(1, epochs + 1):
            it = (
                (e, [to_batch([train[i] for i in mb], 0, cpu) for mb in s])
                for s in plans(grouped, e)
            )
            train_steps(loop, it, steps, progress, lambda s: None)
        return {
            "real_tokens_per_s": round(progress.tokens / progress.train_s, 1),
            "padding_share": round(progress.padding / (progress.tokens + progress.padding), 3),
            "eval_loss": round(eval_loss(loop, eval_batches), 4),
            "train_s": round(progress.train_s, 1),
        }

    before = run(grouped=False)
    after = run(grouped=True)
    return {
        "records": n_train,
        "epochs": epochs,
        "before_random_padded": before,
        "after_length_grouped": after,
        "ratio_real_tokens_per_s": round(
            after["real_tokens_per_s"] / before["real_tokens_per_s"], 2
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=46_599, help="dataset records; default 46599")
    ap.add_argument("--train-records", type=int, default=384, help="part 2's records; default 384")
    ap.add_argument("--epochs", type=int, default=2, help="part 2's epochs; default 2")
    ap.add_argument("--skip-tokenizing", action="store_true", help="part 2 only")
    args = ap.parse_args()

    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    import torch

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory():
        if not args.skip_tokenizing:
            out["time_to_first_step"] = time_to_first_step(args.records)
            print(json.dumps(out["time_to_first_step"]), flush=True)
        out["throughput"] = throughput(args.train_records, args.epochs)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
