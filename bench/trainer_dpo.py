"""lorafleet's DPO against TRL's DPOTrainer with PEFT: tokens/s, peak memory,
final loss and preference accuracy, the same model, data, beta and LoRA.

    # TRL in the bench's environment only, as bench/trainer_trl.py sets it up:
    python -m venv /tmp/trlenv
    echo "import site; site.addsitedir('$PWD/.venv/lib/python3.11/site-packages')" \\
        > /tmp/trlenv/lib/python3.11/site-packages/lorafleet.pth
    /tmp/trlenv/bin/pip install trl==1.16.0
    /tmp/trlenv/bin/python bench/trainer_dpo.py [--records N] [--epochs 1] [--device cuda]

Both train in a fresh process each (peak memory is its own), one torch
thread each, TRL first, on:

- bench/trainer_trl.py's small model (Llama-shaped, hidden 512, 10 layers,
  random weights, the tests' byte-level tokenizer and chat template);
- the same preference pairs: its Q/A records' question as the prompt, its
  answer as the chosen one and another record's answer as the rejected one,
  the same 10% held out (lorafleet_trainer.batches.split_records);
- the same epochs, LoRA (rank 16, alpha 32, dropout 0.05, all-linear),
  learning rate 2e-4, batch 8 pairs, rows cut at 512 tokens, beta 0.1, the
  sigmoid loss, the reference the model with its adapter disabled (TRL's
  default with a PEFT model and no ref_model).

Everything else is each one's default (lorafleet: length-grouped batches,
cosine schedule, the reference pass per micro-batch; TRL 1.16: padded
batches in data order, linear schedule, gradient checkpointing on,
clipping at 1.0). tokens/s: the real (non-padding) tokens of both rows of
every pair trained on, as lorafleet counts them (its summary's
tokens_seen), over each one's training time: the same count for both. The
peak is the RSS on the CPU, NVML's count on a card; lorafleet's job gets
TRL's peak as its memory budget (gpu_memory_mib; --budget-mib another), so
its memory plan keeps it there (bench/trainer_trl.py's first row). Accuracy and margin are
each one's on the held-out pairs at the end (lorafleet's summary, TRL's
evaluate()). The load average is recorded beside each run: the machine may
be shared, and tokens/s are noisy then.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import resource
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from trainer_trl import _DTYPES, BATCH, LORA, LR, MAX_LEN, SEED, _loadavg, _run, build  # noqa: E402

BETA = 0.1


def pairs_of(records: list[dict[str, str]]) -> list[dict[str, str]]:
    """Each record's question and answer over another record's answer."""
    rng = random.Random(SEED)
    out = []
    for i, r in enumerate(records):
        j = rng.randrange(len(records) - 1)
        other = records[j if j < i else j + 1]["a"]
        out.append({"prompt": r["q"], "chosen": r["a"], "rejected": other})
    return out


def run_lorafleet(work: Path, epochs: int, device: str, budget_mib: int | None) -> dict[str, Any]:
    from tests.trainer.harness import TRAINER_ARGV

    data = (work / "pairs.jsonl").read_text()
    job = {
        "job_id": "bench-dpo",
        "base": {"hf_repo": None, "local_dir": str(work / "base")},
        "data_path": str(work / "pairs.jsonl"),
        "data_sha256": hashlib.sha256(data.encode()).hexdigest(),
        "out_dir": str(work / "lorafleet"),
        "params": {
            **LORA, "method": "dpo", "beta": BETA, "learning_rate": LR, "batch_size": BATCH,
            "epochs": epochs, "max_seq_len": MAX_LEN, "eval_fraction": 0.1, "seed": SEED,
            "dtype": _DTYPES[device],
        },
        "device": device,
        "gpu_memory_mib": budget_mib,
    }  # fmt: skip
    (work / "job.json").write_text(json.dumps(job))
    load = _loadavg()
    rc, out, err, nvml_mib = _run([*TRAINER_ARGV, str(work / "job.json")], device)
    lines = [json.loads(x) for x in out.splitlines()]
    if rc != 0:  # a budget no plan fits: its error names the least that would do
        return {"failed": next((x["message"] for x in lines if x["event"] == "error"), err)}
    s = next(x for x in lines if x["event"] == "done")["summary"]
    steps = [x["loss"] for x in lines if x["event"] == "step"]
    pref = s["preference_eval"]
    return {
        "tokens_seen": s["tokens_seen"],
        "train_time_s": s["train_time_s"],
        "real_tokens_per_s": round(s["tokens_seen"] / s["train_time_s"], 1),
        "final_train_loss_last10": round(sum(steps[-10:]) / len(steps[-10:]), 4),
        "eval_loss": round(pref["eval_loss"], 4),
        "eval_accuracy": round(pref["eval_accuracy"], 4),
        "eval_margin": round(pref["eval_margin"], 4),
        "peak_mib": s["peak_mib"] if nvml_mib is None else nvml_mib,
        "estimate_mib": s["memory"]["estimate_mib"],
        "budget_mib": budget_mib,
        "plan": s["memory"]["plan"],
        "loadavg": [load, _loadavg()],
    }


def run_trl(work: Path, epochs: int, device: str) -> None:
    """In its own process: TRL's DPOTrainer on the same pairs and split; prints JSON."""
    import warnings

    warnings.simplefilter("ignore")
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    from lorafleet_trainer.batches import split_records

    torch.set_num_threads(1)
    pairs = [json.loads(x) for x in (work / "pairs.jsonl").read_text().splitlines()]
    train_idx, held_idx = split_records(len(pairs), 0.1, SEED)

    def rows(idx: list[int]) -> Dataset:
        return Dataset.from_list([
            {"prompt": [{"role": "user", "content": pairs[i]["prompt"]}],
             "chosen": [{"role": "assistant", "content": pairs[i]["chosen"]}],
             "rejected": [{"role": "assistant", "content": pairs[i]["rejected"]}]}
            for i in idx
        ])  # fmt: skip

    tok = AutoTokenizer.from_pretrained(work / "base")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(work / "base", dtype=dtype)
    args = DPOConfig(
        output_dir=str(work / "trl"), use_cpu=device == "cpu", bf16=device == "cuda",
        num_train_epochs=epochs, per_device_train_batch_size=BATCH,
        per_device_eval_batch_size=BATCH, learning_rate=LR, max_length=MAX_LEN, beta=BETA,
        loss_type="sigmoid", seed=SEED, report_to=[], save_strategy="no", logging_steps=1,
        disable_tqdm=True,
    )  # fmt: skip
    peft = LoraConfig(
        r=LORA["rank"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
        target_modules="all-linear", task_type="CAUSAL_LM",
    )  # fmt: skip
    trainer = DPOTrainer(
        model=model, args=args, train_dataset=rows(train_idx), eval_dataset=rows(held_idx),
        processing_class=tok, peft_config=peft,
    )  # fmt: skip
    out = trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    ev = trainer.evaluate()
    print(json.dumps({
        "train_time_s": round(out.metrics["train_runtime"], 2),
        "final_train_loss_last_log": round(losses[-1], 4) if losses else None,
        "eval_loss": round(ev["eval_loss"], 4),
        "eval_accuracy": round(ev.get("eval_rewards/accuracies", float("nan")), 4),
        "eval_margin": round(ev.get("eval_rewards/margins", float("nan")), 4),
        "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
        "gradient_checkpointing": args.gradient_checkpointing,
    }))  # fmt: skip


def _trl(work: Path, epochs: int, device: str) -> dict[str, Any]:
    argv = [sys.executable, __file__, "--trl-only-in", str(work), "--epochs", str(epochs)]
    load = _loadavg()
    rc, out, err, nvml_mib = _run([*argv, "--device", device], device)
    if rc != 0:
        raise SystemExit(f"TRL failed:\n{err[-3000:]}")
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    if nvml_mib is not None:
        result["peak_mib"] = nvml_mib
    result["loadavg"] = [load, _loadavg()]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=256, help="pairs; default 256")
    ap.add_argument("--epochs", type=int, default=1, help="epochs of each; default 1")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="default cpu")
    ap.add_argument("--budget-mib", type=int, help="lorafleet's budget; default TRL's peak")
    ap.add_argument("--trl-only-in", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trl_only_in is not None:
        run_trl(args.trl_only_in, args.epochs, args.device)
        return
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        records, n_params = build(work, args.records, "small")
        pairs = pairs_of(records)
        (work / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
        theirs = _trl(work, args.epochs, args.device)
        print(json.dumps({"trl_dpo": theirs}), file=sys.stderr, flush=True)
        budget = args.budget_mib or theirs["peak_mib"]  # no more memory than TRL's
        ours = run_lorafleet(work, args.epochs, args.device, budget)
    if "failed" in ours:
        print(json.dumps({"trl_dpo": theirs, "lorafleet_dpo": ours}, indent=2))
        return
    # The same token count for both: lorafleet's of the same pairs and epochs.
    theirs["real_tokens_per_s"] = round(ours["tokens_seen"] / theirs["train_time_s"], 1)
    speed = ours["real_tokens_per_s"] / theirs["real_tokens_per_s"]
    print(json.dumps({
        "device": args.device, "peak_by": "nvml" if args.device == "cuda" else "rss",
        "model_parameters": n_params, "pairs": args.records, "epochs": args.epochs,
        "beta": BETA, "trl_dpo": theirs, "lorafleet_dpo": ours,
        "ratio_real_tokens_per_s": round(speed, 2),
        "ratio_peak_mib": round(ours["peak_mib"] / theirs["peak_mib"], 3),
        "eval_accuracy_difference": round(ours["eval_accuracy"] - theirs["eval_accuracy"], 4),
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
