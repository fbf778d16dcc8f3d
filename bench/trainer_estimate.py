"""The memory estimate against the trainer's measured peak on a card, and the budget cap.

    python bench/trainer_estimate.py              # on the first card; skipped without one
    python bench/trainer_estimate.py --device cpu # the plumbing only (a tiny model)

A real architecture with random weights, from its published config (no
download): Qwen2.5-0.5B's shapes (24 layers, hidden 896, intermediate 4864,
14 heads, 2 key/value heads, vocabulary 151,936, tied embeddings), the tests'
byte-level tokenizer (its ids fit the vocabulary). Three configurations of
the trainer (`python -m lorafleet_trainer job.json`, in a fresh process each):

- batch 4 x 512 tokens, no gradient checkpointing;
- batch 8 x 1024 tokens, no gradient checkpointing;
- batch 8 x 1024 tokens with gradient checkpointing of every layer.

Each record is cut to exactly max_seq_len, so the estimate's rows are the
real ones. For each: `lorafleet.estimate.estimate_memory(...)` (its total,
CUDA context and slack included) against the process's peak as NVML counts
it (sampled every 50 ms from this process, by the trainer's pid), and
torch's peak reserved MiB (the trainer's step lines). The target is the
estimate within 15% of the NVML peak.

Then the budget: the second configuration again with gpu_memory_mib at 60%
of its estimate, checkpointing fixed off. Expected: the trainer keeps to it
with forward passes of fewer rows (exit 0; on an H100: 5,622 MiB by NVML
under 9,858), or, where nothing fits, exits 1 naming the least budget; its
NVML peak within the budget either way. And once more with
gradient_checkpointing "auto": the trainer checkpoints what it must (its
log line says what), exits 0, its NVML peak within the budget and within
15% of the estimate of its choice.

One JSON summary on stdout; without CUDA (and --device cuda) it prints
{"skipped": true, "reason": ...}.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trainer_gpu import trainer_env  # noqa: E402 (the bench folder, beside this file)

#: Qwen/Qwen2.5-0.5B's config.json, the fields that shape the model.
QWEN25_05B: dict[str, Any] = {
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
}

CONFIGS: list[dict[str, Any]] = [
    {"batch_size": 4, "max_seq_len": 512, "gradient_checkpointing": False},
    {"batch_size": 8, "max_seq_len": 1024, "gradient_checkpointing": False},
    {"batch_size": 8, "max_seq_len": 1024, "gradient_checkpointing": True},
]


def say(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def build_base(out: Path, tiny: bool) -> dict[str, Any]:
    """The random model and the tokenizer in `out`; answers its config.json."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from lorafleet_services.local.tiny_model import TINY_SIZES, build_tokenizer

    tok = build_tokenizer()
    dims = dict(TINY_SIZES, vocab_size=len(tok)) if tiny else dict(QWEN25_05B)
    config = Qwen2Config(**dims, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return dict(json.loads((out / "config.json").read_text()))


def build_data(path: Path, n: int, seq_len: int) -> str:
    """n records whose answers run past seq_len tokens; answers the sha256."""
    import random

    from lorafleet_services.local.tiny_model import TOKENIZER_TEXT

    words = " ".join(TOKENIZER_TEXT).split()
    rng = random.Random(0)
    lines = [
        json.dumps({"q": f"Question {i}?", "a": " ".join(rng.choices(words, k=seq_len))})
        for i in range(n)
    ]
    data = "\n".join(lines) + "\n"
    path.write_text(data, encoding="utf-8")
    return hashlib.sha256(data.encode()).hexdigest()


class NvmlPeak:
    """The peak card MiB NVML counts for one pid, sampled in a thread."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self.peak_mib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        while not self._stop.wait(0.05):
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid == self.pid and proc.usedGpuMemory:
                    self.peak_mib = max(self.peak_mib, proc.usedGpuMemory // (1 << 20))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1)


def run_trainer(work: Path, params: dict[str, Any], device: str, **job: Any) -> dict[str, Any]:
    from tests.trainer.harness import TRAINER_ARGV

    sha = build_data(work / "data.jsonl", 4 * params["batch_size"], params["max_seq_len"])
    spec = {
        "job_id": "bench",
        "base": {"hf_repo": None, "hf_revision": "main", "local_dir": str(work / "base")},
        "data_path": str(work / "data.jsonl"),
        "data_sha256": sha,
        "out_dir": str(work / "out"),
        "params": {"max_steps": 4, "eval_fraction": 0.0, "dtype": "auto", **params},
        "device": device,
        "hf_offline": True,
        **job,
    }
    (work / "job.json").write_text(json.dumps(spec))
    sampler = NvmlPeak() if device == "cuda" else None
    proc = subprocess.Popen(
        [*TRAINER_ARGV, str(work / "job.json")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=trainer_env(),
    )
    if sampler is not None:
        sampler.pid = proc.pid
        sampler.start()
    out, err = proc.communicate(timeout=900)
    if sampler is not None:
        sampler.stop()
    lines = [json.loads(x) for x in out.splitlines()]
    steps = [x for x in lines if x["event"] == "step"]
    return {
        "rc": proc.returncode,
        "error": next((x["message"] for x in lines if x["event"] == "error"), None),
        "nvml_peak_mib": sampler.peak_mib if sampler is not None else None,
        "torch_peak_mib": max((s["peak_mib"] for s in steps), default=None),
        "stderr_tail": err[-800:] if proc.returncode else "",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = ap.parse_args()
    import torch

    from lorafleet.estimate import architecture_from_config, estimate_memory
    from lorafleet_schemas.messages import TrainerParams

    if args.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"skipped": True, "reason": "no CUDA card"}))
        return
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        config = build_base(work / "base", tiny=args.device == "cpu")
        arch = architecture_from_config(config)
        configs = CONFIGS[:1] if args.device == "cpu" else CONFIGS
        for params in configs:
            est = estimate_memory(arch, TrainerParams(**params), device=args.device)
            say(f"{params}: estimate {est.total_mib} MiB")
            got = run_trainer(work, params, args.device)
            measured = got["nvml_peak_mib"]
            results.append(
                {
                    "params": params,
                    "estimate_mib": est.total_mib,
                    "lines_mib": {x.name: x.mib for x in est.lines},
                    **got,
                    "estimate_over_measured": round(est.total_mib / measured, 3)
                    if measured
                    else None,
                }
            )
        budget: dict[str, Any] | None = None
        auto: dict[str, Any] | None = None
        if args.device == "cuda":
            est = estimate_memory(arch, TrainerParams(**CONFIGS[1]))
            cap = int(est.total_mib * 0.6)
            got = run_trainer(work, CONFIGS[1], "cuda", gpu_memory_mib=cap)
            budget = {"gpu_memory_mib": cap, "estimate_mib": est.total_mib, **got}
            params = {**CONFIGS[1], "gradient_checkpointing": "auto"}
            chosen = estimate_memory(arch, TrainerParams(**params), budget_mib=cap)
            got = run_trainer(work, params, "cuda", gpu_memory_mib=cap)
            measured = got["nvml_peak_mib"]
            auto = {
                "gpu_memory_mib": cap,
                "estimate_mib": chosen.total_mib,
                "activations": chosen.lines[4].note,
                **got,
                "estimate_over_measured": round(chosen.total_mib / measured, 3)
                if measured
                else None,
            }
    print(json.dumps({"estimates": results, "budget": budget, "auto": auto}, indent=2))


if __name__ == "__main__":
    main()
