"""The demo's job fits its own memory budget: the trainer holds a CPU job to
its gpu_memory_mib, so a nominal budget fails the README's first command."""

from __future__ import annotations

import json
from pathlib import Path

from lorafleet_services.demo import demo_job
from lorafleet_services.local.tiny_model import build_tiny_model
from lorafleet_trainer import memory, plans


def test_the_demo_job_fits_its_budget_on_the_cpu(tmp_path: Path) -> None:
    model = build_tiny_model("llama", tmp_path / "tiny-llama")
    arch = memory.architecture_from_config(json.loads((model / "config.json").read_text()))
    job = demo_job()
    params = job.params
    assert params is not None
    plan = plans.choose_plan(arch, params, "cpu", params.max_seq_len, job.gpu_memory_mib)
    assert plan.fits, f"{job.gpu_memory_mib} MiB: {plan.reason}"
