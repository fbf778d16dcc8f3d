"""Fixtures of the trainer's tests: tiny models and real training runs, built once."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from lorafleet_services.local.tiny_model import build_tiny_model
from tests.trainer.harness import (
    TrainerRun,
    ndjson,
    qa_records,
    run_trainer,
    write_job,
)

#: What the training runs use: 16 records, 2 held out, 4 steps an epoch.
TRAIN_PARAMS: dict[str, Any] = {
    "rank": 8,
    "alpha": 16,
    "dropout": 0.05,
    "learning_rate": 0.02,
    "lr_scheduler": "cosine",
    "warmup_steps": 2,
    "epochs": 6,
    "batch_size": 4,
    "eval_fraction": 0.125,
    "max_seq_len": 64,
    "seed": 7,
}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`tiny_model("llama" | "qwen2")`: the model's directory, built once per session."""
    built: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in built:
            built[arch] = build_tiny_model(arch, tmp_path_factory.mktemp(f"tiny-{arch}"))  # type: ignore[arg-type]
        return built[arch]

    return get


@pytest.fixture(scope="session")
def trained(
    tiny_model: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], tuple[TrainerRun, Path]]:
    """`trained(arch)`: a real training run of the tiny model (once per session)
    and its job file."""
    runs: dict[str, tuple[TrainerRun, Path]] = {}

    def get(arch: str) -> tuple[TrainerRun, Path]:
        if arch not in runs:
            job = write_job(
                tmp_path_factory.mktemp(f"job-{arch}"),
                tiny_model(arch),
                data=ndjson(qa_records()),
                params=TRAIN_PARAMS,
            )
            run = run_trainer(job)
            assert run.rc == 0, run.stderr[-3000:]
            runs[arch] = (run, job)
        return runs[arch]

    return get
