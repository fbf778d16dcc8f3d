"""lorafleet's trainer against TRL's SFTTrainer with PEFT: real tokens/s, loss, peak memory.

    python -m venv /tmp/trlenv
    echo "import site; site.addsitedir('$PWD/.venv/lib/python3.11/site-packages')" \\
        > /tmp/trlenv/lib/python3.11/site-packages/lorafleet.pth
    /tmp/trlenv/bin/pip install trl==1.16.0      # TRL in the bench's environment only
    /tmp/trlenv/bin/python bench/trainer_trl.py [--case large] [--records N] \\
        [--epochs 1] [--budget-mib MIB] [--checkpointing true] [--lorafleet-only] \\
        [--device cuda]

The .pth lends the bench's environment lorafleet's (torch, transformers,
the editable install of the three import roots): `site.addsitedir` also
runs that directory's own .pth files, which is how the editable install
puts the roots on the path; a .pth naming the directory alone adds it but
runs none of them (`No module named 'lorafleet_services'`).

Both train, each in a fresh process (peak memory is its own), one torch
thread each, TRL first:

- the same model: a Llama-shaped model built on the spot with random weights
  (hidden 512, 10 layers, 8 heads, 4 key/value heads, intermediate 1376) and
  the tests' byte-level tokenizer and chat template. Case "small" (default):
  the tokenizer's vocabulary, about 29M parameters, Q/A records with a
  long-tailed length distribution from 16 to 512 tokens (most short, a few
  long); case "large": Qwen2's 152,064-token vocabulary (about 185M
  parameters, the rows past the tokenizer's never seen as input but each in
  every softmax), records of about 512 tokens, so batches of 8 x 512;
- the same data, the same 10% held out;
- the same epochs, the same LoRA (rank 16, alpha 32, dropout 0.05,
  all-linear), learning rate 2e-4, batch size 8, records cut at 512 tokens,
  loss on the answers only.

On the CPU (the default) both train in fp32 and the peak is the RSS; with
`--device cuda` both in bf16 on the first card, the peak is NVML's for the
process (sampled every 50 ms).

lorafleet's job gets a memory budget (gpu_memory_mib: on the CPU the
process's RSS, on a card NVML's count), three in turn after TRL's run, one
table: TRL's peak, half of it, and the smallest the trainer accepts (what
its error names when given 1 MiB: the least estimate of any memory plan).
Each row: the trainer's plan (its log line; whether it tightened as it
went), its estimate, its peak against the budget, real tokens/s against
TRL's, and the eval loss. Targets: every peak under its budget; on the CPU
the estimate within 10% of the peak; at TRL's peak at least 1.5x TRL's
tokens/s, at half of it still faster. `--budget-mib` runs one budget
instead (`--lorafleet-only` skips TRL), `--checkpointing` fixes
gradient_checkpointing (default "auto"). The machine's load average is
recorded beside each run: on a shared machine tokens/s are noisy.

Everything else is each one's default: lorafleet's length-grouped batches,
cosine schedule, its loss over chunks; SFTTrainer's (TRL 1.16) padded
batches in data order, linear schedule, gradient checkpointing on, gradient
clipping at 1.0, fused AdamW. Measured: real (non-padding) tokens per second
of training (lorafleet: tokens_seen / train_time_s of its summary; TRL: the
tokens of its tokenized training set times the epochs / train_runtime), the
held-out loss of each (mean cross-entropy per answer token; TRL's is the mean
of its eval batches' means), the final training loss, the peak.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import random
import re
import resource
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SIZES = {
    "hidden_size": 512,
    "intermediate_size": 1376,
    "num_hidden_layers": 10,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
}
LORA = {"rank": 16, "alpha": 32, "dropout": 0.05}
BATCH, LR, MAX_LEN, SEED = 8, 2e-4, 512, 42
#: Qwen2's vocabulary, for the "large" case.
LARGE_VOCAB = 152_064


def build(work: Path, n: int, case: str) -> tuple[list[dict[str, str]], int]:
    """The model directory and the records; answers them and the parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from lorafleet_services.local.tiny_model import TOKENIZER_TEXT, build_tokenizer

    tok = build_tokenizer()
    config = LlamaConfig(
        **SIZES,
        vocab_size=LARGE_VOCAB if case == "large" else len(tok),
        max_position_embeddings=1024,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        initializer_range=0.1,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(work / "base", safe_serialization=True)
    tok.save_pretrained(work / "base")
    words = " ".join(TOKENIZER_TEXT).replace("?", "").replace(".", "").split()
    rng = random.Random(0)
    records = []
    for i in range(n):
        # About 1.6 tokens a word with this tokenizer: 8 to 320 words, most
        # short; in the large case all about 320 (cut at 512 tokens).
        answer_words = 330 if case == "large" else min(300, 4 + int(rng.paretovariate(1.1) * 6))
        q = f"Question {i}: " + " ".join(rng.choices(words, k=rng.randint(3, 12))) + "?"
        records.append({"q": q, "a": " ".join(rng.choices(words, k=answer_words))})
    (work / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return records, int(sum(p.numel() for p in model.parameters()))


def run_lorafleet(
    work: Path,
    records: list[dict[str, str]],
    epochs: int,
    budget_mib: int | None,
    checkpointing: Any,
    device: str,
) -> dict[str, Any]:
    from tests.trainer.harness import TRAINER_ARGV

    data = (work / "data.jsonl").read_text()
    job = {
        "job_id": "bench",
        "base": {"hf_repo": None, "local_dir": str(work / "base")},
        "data_path": str(work / "data.jsonl"),
        "data_sha256": hashlib.sha256(data.encode()).hexdigest(),
        "out_dir": str(work / "lorafleet"),
        "params": {
            **LORA,
            "learning_rate": LR,
            "batch_size": BATCH,
            "epochs": epochs,
            "max_seq_len": MAX_LEN,
            "eval_fraction": 0.1,
            "seed": SEED,
            "dtype": _DTYPES[device],
            "gradient_checkpointing": checkpointing,
        },
        "device": device,
        "gpu_memory_mib": budget_mib,
    }
    (work / "job.json").write_text(json.dumps(job))
    load = _loadavg()
    rc, out, err, nvml_mib = _run([*TRAINER_ARGV, str(work / "job.json")], device)
    lines = [json.loads(x) for x in out.splitlines()]
    if rc != 0:
        error = next((x["message"] for x in lines if x["event"] == "error"), err[-2000:])
        return {"failed": error}
    s = next(x for x in lines if x["event"] == "done")["summary"]
    steps = [x["loss"] for x in lines if x["event"] == "step"]
    logs = [x["message"] for x in lines if x["event"] == "log"]
    peak = s["peak_mib"] if nvml_mib is None else nvml_mib
    estimate = s["memory"]["estimate_mib"]
    return {
        "plan": next(m for m in logs if m.startswith("memory plan:")),
        "tightened": [m for m in logs if m.startswith("memory plan tightened")],
        "final_plan": s["memory"]["final_plan"],
        "real_tokens_per_s": round(s["tokens_seen"] / s["train_time_s"], 1),
        "tokens_seen": s["tokens_seen"],
        "padding_tokens": s["padding_tokens"],
        "train_time_s": s["train_time_s"],
        "eval_loss": round(s["eval_loss"], 4),
        "final_train_loss_last10": round(sum(steps[-10:]) / len(steps[-10:]), 4),
        "peak_mib": peak,
        "estimate_mib": estimate,
        "estimate_over_peak": round(estimate / peak, 3) if estimate else None,
        "loadavg": [load, _loadavg()],
    }


def _loadavg() -> str:
    """The machine's load averages (1, 5, 15 min): tokens/s are noisy under load."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return ""


#: Each device's dtype, for both trainers: fp32 on the CPU, bf16 on a card.
_DTYPES = {"cpu": "fp32", "cuda": "bf16"}


def _run(argv: list[str], device: str) -> tuple[int, str, str, int | None]:
    """Run `argv`; its exit status, stdout, stderr and, on a card, its NVML peak MiB."""
    sampler = None
    if device == "cuda":
        from trainer_estimate import NvmlPeak  # the bench folder, beside this file

        sampler = NvmlPeak()
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()
    )
    if sampler is not None:
        sampler.pid = proc.pid
        sampler.start()
    out, err = proc.communicate()
    if sampler is not None:
        sampler.stop()
    return proc.returncode, out, err, None if sampler is None else sampler.peak_mib


def run_trl(work: Path, epochs: int, device: str) -> None:
    """In its own process: TRL's SFTTrainer on the same records and split; prints JSON."""
    import warnings

    warnings.simplefilter("ignore")
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from lorafleet_trainer.batches import split_records

    torch.set_num_threads(1)
    records = [json.loads(x) for x in (work / "data.jsonl").read_text().splitlines()]
    train_idx, held_idx = split_records(len(records), 0.1, SEED)

    def rows(idx: list[int]) -> Dataset:
        return Dataset.from_list(
            [
                {
                    "prompt": [{"role": "user", "content": records[i]["q"]}],
                    "completion": [{"role": "assistant", "content": records[i]["a"]}],
                }
                for i in idx
            ]
        )

    tok = AutoTokenizer.from_pretrained(work / "base")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(work / "base", dtype=dtype)
    args = SFTConfig(
        output_dir=str(work / "trl"),
        use_cpu=device == "cpu",
        bf16=device == "cuda",
        num_train_epochs=epochs,
        per_device_train_batch_size=BATCH,
        per_device_eval_batch_size=BATCH,
        learning_rate=LR,
        max_length=MAX_LEN,
        seed=SEED,
        report_to=[],
        save_strategy="no",
        logging_steps=10,
        disable_tqdm=True,
    )
    peft = LoraConfig(
        r=LORA["rank"],
        lora_alpha=LORA["alpha"],
        lora_dropout=LORA["dropout"],
        target_modules="all-linear",
        task_type="CAUSAL_LM",
    )
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=rows(train_idx),
        eval_dataset=rows(held_idx),
        processing_class=tok,
        peft_config=peft,
    )
    tokens = sum(len(x) for x in trainer.train_dataset["input_ids"]) * epochs
    out = trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    result = {
        "real_tokens_per_s": round(tokens / out.metrics["train_runtime"], 1),
        "tokens_seen": tokens,
        "train_time_s": round(out.metrics["train_runtime"], 2),
        "eval_loss": round(trainer.evaluate()["eval_loss"], 4),
        "final_train_loss_last_log": round(losses[-1], 4) if losses else None,
        "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
        "gradient_checkpointing": args.gradient_checkpointing,
    }
    print(json.dumps(result))


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    return env


def _switch(v: str) -> bool | str:
    return {"true": True, "false": False}.get(v, v)


def _trl(work: Path, epochs: int, device: str) -> dict[str, Any]:
    argv = [sys.executable, __file__, "--trl-only-in", str(work), "--epochs", str(epochs)]
    rc, out, err, nvml_mib = _run([*argv, "--device", device], device)
    if rc != 0:
        raise SystemExit(f"TRL failed:\n{err[-3000:]}")
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    if nvml_mib is not None:
        result["peak_mib"] = nvml_mib
    return result


def _smallest_budget(error: str) -> int | None:
    """The smallest budget the trainer's refusal names."""
    m = re.search(r"give it at least (\d+) MiB", error)
    return int(m.group(1)) if m else None


def _row(name: str, budget: int | None, ours: dict[str, Any], theirs: Any) -> dict[str, Any]:
    """One row of the table: lorafleet at `budget` against TRL."""
    if "failed" in ours:
        return {"budget": name, "budget_mib": budget, "failed": ours["failed"]}
    row = {
        "budget": name,
        "budget_mib": budget,
        "peak_mib": ours["peak_mib"],
        "under_budget": budget is None or ours["peak_mib"] <= budget,
        "estimate_mib": ours["estimate_mib"],
        "estimate_over_peak": ours["estimate_over_peak"],
        "real_tokens_per_s": ours["real_tokens_per_s"],
        "eval_loss": ours["eval_loss"],
        "plan": ours["plan"],
        "tightened": len(ours["tightened"]),
        "loadavg": ours["loadavg"],
    }
    if theirs is not None:
        row["ratio_real_tokens_per_s"] = round(
            ours["real_tokens_per_s"] / theirs["real_tokens_per_s"], 2
        )
        row["eval_loss_difference"] = round(ours["eval_loss"] - theirs["eval_loss"], 4)
    return row


def _budgets(args: argparse.Namespace, work: Path, records: Any, theirs: Any) -> list[Any]:
    """The table's rows: one budget given, or TRL's peak, half of it and the
    smallest the trainer accepts."""
    go = functools.partial(run_lorafleet, work, records, args.epochs)
    if args.budget_mib is not None or (theirs is None and not args.smallest):
        ours = go(args.budget_mib, args.checkpointing, args.device)
        return [_row("given", args.budget_mib, ours, theirs)]
    rows = []
    for name, share in (("TRL's peak", 1.0), ("half TRL's peak", 0.5)):
        if theirs is None:
            break
        budget = int(share * theirs["peak_mib"])
        rows.append(_row(name, budget, go(budget, args.checkpointing, args.device), theirs))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    # The process measures itself before each run: a few MiB apart, so a
    # budget named by one refusal may be refused by the next by as much.
    budget, ours = 1, go(1, args.checkpointing, args.device)
    for _ in range(4):
        smallest = _smallest_budget(ours.get("failed", ""))
        if smallest is None:
            break
        budget, ours = smallest, go(smallest, args.checkpointing, args.device)
    rows.append(_row("smallest accepted", budget, ours, theirs))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", choices=["small", "large"], default="small", help="default small")
    ap.add_argument("--records", type=int, default=512, help="records; default 512")
    ap.add_argument("--epochs", type=int, default=1, help="epochs of each; default 1")
    ap.add_argument("--budget-mib", type=int, help="one budget; default three (TRL's peak...)")
    ap.add_argument("--checkpointing", type=_switch, default="auto", help="lorafleet's; auto")
    ap.add_argument("--lorafleet-only", action="store_true", help="skip TRL")
    ap.add_argument("--smallest", action="store_true", help="with --lorafleet-only: that row")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="default cpu")
    ap.add_argument("--trl-only-in", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trl_only_in is not None:
        run_trl(args.trl_only_in, args.epochs, args.device)
        return
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        records, n_params = build(work, args.records, args.case)
        load = _loadavg()
        theirs = None if args.lorafleet_only else _trl(work, args.epochs, args.device)
        if theirs is not None:
            theirs["loadavg"] = [load, _loadavg()]
        print(json.dumps({"trl_sft": theirs}), file=sys.stderr, flush=True)
        rows = _budgets(args, work, records, theirs)
    out: dict[str, Any] = {
        "case": args.case,
        "device": args.device,
        "peak_by": "nvml" if args.device == "cuda" else "rss",
        "model_parameters": n_params,
        "records": args.records,
        "epochs": args.epochs,
        "trl_sft": theirs,
        "lorafleet": rows,
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
