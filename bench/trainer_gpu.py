"""The trainer against a Hugging Face Trainer + PEFT baseline on a card: tokens/s and peak MiB.

    python bench/trainer_gpu.py                 # ~134M-param Llama, on the first card
    python bench/trainer_gpu.py --steps 40 --batch-size 16 --seq-len 1024
    python bench/trainer_gpu.py --device cpu --size tiny --steps 6   # a smoke run, no card

Needs torch (with CUDA for a real run), transformers, peft, accelerate and
tokenizers; nothing is downloaded. It builds on the spot, in a temporary
directory:

- a Llama with random weights: "100m" is hidden 768, 12 layers, 12 heads,
  intermediate 2048, vocabulary 32000 (so the LM head costs what a real
  one does), about 134M parameters; "tiny" is the tests' 64-wide model;
- the tests' byte-level tokenizer and chat template
  (services/lorafleet_services/local/tiny_model.py);
- Q/A records whose answers run past --seq-len, so every record is cut to
  exactly --seq-len tokens and every step holds batch-size x seq-len tokens.

Then, each in a fresh process (so that peak memory is its own):

- lorafleet: the trainer itself, `python -m lorafleet_trainer job.json` (trainer/lorafleet_trainer);
- hf_trainer: transformers.Trainer on a peft model, the same tokens and
  labels (encoded by the trainer's own functions), the same LoRA
  (rank 16, alpha 32, dropout 0.05, all-linear), AdamW (torch), constant
  learning rate 2e-4, no gradient clipping (the trainer does none), the same
  dtype (bf16 on cards that have it, else fp16; fp32 on the CPU) and the
  same gradient checkpointing setting. Its collator passes an attention
  mask, as Hugging Face's collators do; the trainer leaves it out of batches
  that have no padding (all of them here), which spares transformers a
  check that waits for the card on every forward: part of what is measured.

tokens/s is measured over the steps after the first --warmup-steps (default
5), from the end of one step to the end of the next (so making batches
counts): the trainer's from its step lines, the baseline's from a callback
that synchronizes the card at each step's end. Peak MiB is torch's peak
reserved memory on the card (peak RSS on the CPU).

It prints one JSON summary on stdout (progress on stderr). Without CUDA (and
--device cuda) it prints {"skipped": true, "reason": ...} and exits 0.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SIZES: dict[str, dict[str, int]] = {
    "100m": {
        "hidden_size": 768,
        "intermediate_size": 2048,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "num_key_value_heads": 12,
        "vocab_size": 32000,
    },
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 0,  # the tokenizer's
    },
}

LORA: dict[str, Any] = {
    "rank": 16,
    "alpha": 32,
    "dropout": 0.05,
    "target_modules": "all-linear",
    "learning_rate": 2e-4,
    "lr_scheduler": "constant",
    "warmup_steps": 0,
    "gradient_accumulation": 1,
    "eval_fraction": 0,
    "seed": 0,
    "dtype": "auto",
}


def say(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def build_base(size: str, out: Path, seq_len: int) -> int:
    """Write the random Llama and the tokenizer into `out`; answer its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from lorafleet_services.local.tiny_model import build_tokenizer

    tok = build_tokenizer()
    dims = dict(SIZES[size])
    dims["vocab_size"] = dims["vocab_size"] or len(tok)
    config = LlamaConfig(
        **dims,
        max_position_embeddings=max(2048, seq_len),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return int(sum(p.numel() for p in model.parameters()))


def build_data(path: Path, n: int, seq_len: int) -> str:
    """n Q/A records with answers long enough to be cut at seq_len; answer the sha256."""
    from lorafleet_services.local.tiny_model import TOKENIZER_TEXT

    words = " ".join(TOKENIZER_TEXT).split()
    rng = random.Random(0)
    lines = []
    for i in range(n):
        q = f"Question {i}: " + " ".join(rng.choices(words, k=8)) + "?"
        # The byte-level tokenizer makes a token of about 2 characters here;
        # 2 tokens a word is a generous bound for the cut to happen.
        a = " ".join(rng.choices(words, k=seq_len))
        lines.append(json.dumps({"q": q, "a": a}))
    data = "\n".join(lines) + "\n"
    path.write_text(data, encoding="utf-8")
    return hashlib.sha256(data.encode()).hexdigest()


def run_lorafleet(work: Path, args: argparse.Namespace, sha: str) -> dict[str, Any]:
    from tests.trainer.harness import TRAINER_ARGV

    job = {
        "job_id": "bench",
        "base": {"hf_repo": None, "hf_revision": "main", "local_dir": str(work / "base")},
        "data_path": str(work / "data.jsonl"),
        "data_sha256": sha,
        "out_dir": str(work / "lorafleet"),
        "params": {
            **LORA,
            "max_steps": args.steps,
            "batch_size": args.batch_size,
            "max_seq_len": args.seq_len,
            "gradient_checkpointing": args.gradient_checkpointing,
        },
        "device": args.device,
        "hf_offline": True,
    }
    (work / "job.json").write_text(json.dumps(job))
    t0 = time.perf_counter()
    p = subprocess.run(
        [*TRAINER_ARGV, str(work / "job.json")],
        capture_output=True,
        text=True,
        check=False,
        env=trainer_env(),
    )
    wall = time.perf_counter() - t0
    lines = [json.loads(x) for x in p.stdout.splitlines()]
    if p.returncode != 0:
        raise SystemExit(f"the trainer failed ({p.returncode}): {lines[-1:]}\n{p.stderr[-3000:]}")
    steps = [x for x in lines if x["event"] == "step"]
    done = next(x for x in lines if x["event"] == "done")["summary"]
    tokens_per_step = args.batch_size * args.seq_len
    timed = steps[args.warmup_steps :]
    step_s = [tokens_per_step / s["tokens_per_s"] for s in timed]
    return {
        "tokens_per_s": round(len(timed) * tokens_per_step / sum(step_s), 1),
        # A median step is what a stall of the machine does not move.
        "tokens_per_s_median_step": round(tokens_per_step / statistics.median(step_s), 1),
        "peak_mib": max(s["peak_mib"] for s in steps),
        "final_loss": steps[-1]["loss"],
        "first_loss": steps[0]["loss"],
        "dtype": done["dtype"],
        "records_cut": done["records_cut"],
        "train_time_s": done["train_time_s"],
        "process_wall_s": round(wall, 2),
    }


def run_baseline(work: Path) -> None:
    """The Hugging Face Trainer + PEFT run (in its own process); prints its JSON result."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from lorafleet_trainer.base_model import _load_kwargs
    from lorafleet_trainer.batches import collate
    from lorafleet_trainer.loop import resolve_dtype, torch_dtype
    from lorafleet_trainer.rendering import Encoded, chat_template_of, encode_conversation
    from lorafleet_trainer.run import load_records

    cfg = json.loads((work / "baseline.json").read_text())
    cuda = cfg["device"] == "cuda"
    dtype = resolve_dtype("auto", cfg["device"])
    base = str(work / "base")
    tok = AutoTokenizer.from_pretrained(base)
    template = chat_template_of(tok)
    records = [c for _, c in load_records(work / "data.jsonl", cfg["sha256"])]
    encoded = [encode_conversation(tok, template, c, cfg["seq_len"]) for c in records]
    rows = [{"input_ids": e.input_ids, "labels": e.labels} for e in encoded]

    def to_tensors(batch: list[dict[str, list[int]]]) -> dict[str, Any]:
        ids, mask, labels = collate(
            [Encoded(b["input_ids"], b["labels"], False) for b in batch], tok.pad_token_id
        )
        return {
            "input_ids": torch.tensor(ids),
            "attention_mask": torch.tensor(mask),
            "labels": torch.tensor(labels),
        }

    model = AutoModelForCausalLM.from_pretrained(
        base,
        use_safetensors=True,
        **_load_kwargs(torch_dtype(dtype)),  # dtype= or torch_dtype=, by version
        **({"device_map": {"": "cuda:0"}} if cuda else {}),
    )
    model.config.use_cache = False
    if cfg["gradient_checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    model = get_peft_model(
        model,
        LoraConfig(
            r=LORA["rank"],
            lora_alpha=LORA["alpha"],
            lora_dropout=LORA["dropout"],
            target_modules=LORA["target_modules"],
            task_type="CAUSAL_LM",
        ),
    )
    ends: list[float] = []

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    class Clock(TrainerCallback):  # type: ignore[misc]
        """From the end of the last warm-up step to the end of the last step: what
        happens between steps (fetching and collating the batch) counts, as it
        does in the trainer's own step times."""

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            sync()
            if state.global_step >= cfg["warmup_steps"]:
                ends.append(time.perf_counter())

    targs = TrainingArguments(
        output_dir=str(work / "hf"),
        per_device_train_batch_size=cfg["batch_size"],
        gradient_accumulation_steps=1,
        max_steps=cfg["steps"],
        learning_rate=LORA["learning_rate"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        max_grad_norm=0.0,
        bf16=dtype == "bf16",
        fp16=dtype == "fp16",
        use_cpu=not cuda,
        logging_strategy="no",
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
        remove_unused_columns=False,
        seed=0,
    )
    trainer = Trainer(
        model=model, args=targs, train_dataset=rows, data_collator=to_tensors, callbacks=[Clock()]
    )
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out = trainer.train()
    wall = time.perf_counter() - t0
    step_s = [b - a for a, b in itertools.pairwise(ends)]
    tokens_per_step = cfg["batch_size"] * cfg["seq_len"]
    peak = (
        int(torch.cuda.max_memory_reserved() // (1 << 20))
        if cuda
        else int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
    )
    print(
        json.dumps(
            {
                "tokens_per_s": round(len(step_s) * tokens_per_step / sum(step_s), 1),
                "tokens_per_s_median_step": round(tokens_per_step / statistics.median(step_s), 1),
                "peak_mib": peak,
                "train_loss": out.training_loss,
                "dtype": dtype,
                "train_time_s": round(wall, 3),
            }
        )
    )


def trainer_env() -> dict[str, str]:
    """The trainer's environment, as the agent sets it for a job (what the
    GPU benches share)."""
    import os

    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        TOKENIZERS_PARALLELISM="false",
        PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True",
        PYTHONUNBUFFERED="1",
    )
    return env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="100m")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--steps", type=int, default=60, help="optimizer steps; default 60")
    ap.add_argument("--warmup-steps", type=int, default=5, help="steps not timed; default 5")
    ap.add_argument("--batch-size", type=int, default=8, help="records a step; default 8")
    ap.add_argument("--seq-len", type=int, default=512, help="tokens a record; default 512")
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--baseline-only-in", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.baseline_only_in is not None:
        run_baseline(args.baseline_only_in)
        return
    if args.warmup_steps >= args.steps:
        raise SystemExit("--warmup-steps must be below --steps")

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        reason = (
            f"no CUDA device visible to torch {torch.__version__} "
            f"(CUDA build: {torch.version.cuda}); run on a card, or --device cpu --size tiny "
            "for a smoke run"
        )
        say(reason)
        print(json.dumps({"skipped": True, "reason": reason}))
        return

    with tempfile.TemporaryDirectory(prefix="lorafleet-bench-") as tmp:
        work = Path(tmp)
        say(f"building the {args.size} Llama and {args.steps * args.batch_size} records")
        n_params = build_base(args.size, work / "base", args.seq_len)
        sha = build_data(work / "data.jsonl", args.steps * args.batch_size, args.seq_len)
        say("running the lorafleet trainer")
        ours = run_lorafleet(work, args, sha)
        if ours["records_cut"] != args.steps * args.batch_size:
            say(f"warning: only {ours['records_cut']} records were cut to --seq-len")
        say("running the Hugging Face Trainer + PEFT baseline")
        (work / "baseline.json").write_text(
            json.dumps(
                {
                    "device": args.device,
                    "sha256": sha,
                    "seq_len": args.seq_len,
                    "batch_size": args.batch_size,
                    "steps": args.steps,
                    "warmup_steps": args.warmup_steps,
                    "gradient_checkpointing": args.gradient_checkpointing,
                }
            )
        )
        p = subprocess.run(
            [sys.executable, __file__, "--baseline-only-in", str(work)],
            capture_output=True,
            text=True,
            check=False,
            env=trainer_env(),
        )
        if p.returncode != 0:
            raise SystemExit(f"the baseline failed ({p.returncode}):\n{p.stderr[-3000:]}")
        hf = json.loads(p.stdout.strip().splitlines()[-1])

    card = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    summary = {
        "device": card,
        "model": f"llama-{args.size}",
        "parameters": n_params,
        "settings": {
            "steps": args.steps,
            "timed_steps": args.steps - args.warmup_steps,
            "batch_size": args.batch_size,
            "seq_len": args.seq_len,
            "gradient_checkpointing": args.gradient_checkpointing,
            **{k: LORA[k] for k in ("rank", "alpha", "dropout", "target_modules")},
        },
        "versions": {"torch": torch.__version__, **_versions()},
        "lorafleet": ours,
        "hf_trainer": hf,
        "tokens_per_s_ratio": round(ours["tokens_per_s"] / hf["tokens_per_s"], 3),
        "median_step_tokens_per_s_ratio": round(
            ours["tokens_per_s_median_step"] / hf["tokens_per_s_median_step"], 3
        ),
        "peak_mib_ratio": round(ours["peak_mib"] / hf["peak_mib"], 3),
    }
    say(
        f"lorafleet {ours['tokens_per_s']:.0f} tokens/s, {ours['peak_mib']} MiB; "
        f"HF Trainer {hf['tokens_per_s']:.0f} tokens/s, {hf['peak_mib']} MiB"
    )
    print(json.dumps(summary, indent=2))


def _versions() -> dict[str, str]:
    from importlib import metadata

    return {n: metadata.version(n) for n in ("transformers", "peft", "accelerate")}


if __name__ == "__main__":
    main()
