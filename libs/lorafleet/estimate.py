"""The peak card memory of a LoRA training job, estimated before it runs.

`estimate_memory(arch, params)` is a pure function of the model's shapes (a
`ModelArchitecture`, from its config.json) and the trainer's parameters; it
answers a `MemoryEstimate` whose lines (weights, adapter, gradients,
optimizer states, activations; on a card the CUDA context and allocator
slack, on the CPU the process and the heap's slack) add up to the
total. Only the Llama-shaped decoder family is estimated; other target
modules, or a model without its architecture, get `EstimateError`.
`read_architecture(...)` finds config.json locally or in the Hugging Face
cache, never downloading. What each line counts: libs/lorafleet/DESIGN.md.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

import msgspec

from lorafleet_schemas.messages import (
    EstimateLine,
    MemoryEstimate,
    ModelArchitecture,
    ModelSpec,
    TrainerParams,
)
from lorafleet_trainer import memory, plans

# The error this module raises is the arithmetic's own, exported for its callers.
from lorafleet_trainer.memory import EstimateError as EstimateError

MIB = memory.MIB

#: The share a submit without gpu_memory_mib adds to the estimate.
MARGIN_FRACTION = 0.10


def _line(name: str, n: int, note: str) -> EstimateLine:
    return EstimateLine(name=name, bytes=n, mib=round(n / MIB, 1), note=note)


def estimate_memory(
    arch: ModelArchitecture,
    params: TrainerParams,
    *,
    device: str = "cuda",
    seq_len: int | None = None,
    budget_mib: int | None = None,
) -> MemoryEstimate:
    """The peak memory of training `arch` with `params` on `device` ("cuda" or
    "cpu"), line by line. `seq_len`: the longest row a micro-batch holds (the
    data's longest record, when known); default max_seq_len. `budget_mib`:
    the job's gpu_memory_mib, by which the trainer chooses its memory plan
    (`lorafleet_trainer.plans.choose_plan`: checkpointing, heap, forward
    passes), as the trainer does; without one, the plan of no checkpointing
    ("auto"), the C library's heap and whole micro-batches."""
    rows = min(seq_len or params.max_seq_len, params.max_seq_len)
    choice = plans.choose_plan(arch, params, device, rows, budget_mib)
    lines = [
        _line(name, n, note)
        for name, n, note in memory.plan_lines(arch, params, device, rows, choice.plan)
    ]
    total = sum(x.bytes for x in lines)
    total_mib = math.ceil(total / MIB)
    return MemoryEstimate(
        lines=lines,
        total_bytes=total,
        total_mib=total_mib,
        recommended_mib=math.ceil(total_mib * (1 + MARGIN_FRACTION)),
        margin_fraction=MARGIN_FRACTION,
        seq_len=rows,
        dtype=memory.training_dtype(params.dtype, device),
    )


def shortfall_message(estimate: MemoryEstimate, gpu_memory_mib: int) -> str:
    """Why `gpu_memory_mib` is refused, with both numbers and what to change."""
    return (
        f"gpu_memory_mib {gpu_memory_mib} is below the memory estimate of "
        f"{estimate.total_mib} MiB ({estimate.recommended_mib} MiB with the "
        f"{estimate.margin_fraction:.0%} margin); give at least {estimate.total_mib}, "
        "or lower params.batch_size or params.max_seq_len (raising "
        "gradient_accumulation keeps the batch), or set params.gradient_checkpointing "
        'to "auto" or true; or submit anyway with ignore_estimate'
    )


# --- config.json -------------------------------------------------------------


def architecture_from_config(config: dict[str, Any]) -> ModelArchitecture:
    """The estimate's fields of a Hugging Face config.json (its text_config for a
    multimodal one). EstimateError naming what is missing."""
    return msgspec.convert(
        dataclasses.asdict(memory.architecture_from_config(config)), ModelArchitecture
    )


def _hf_cache_config(hf_repo: str, revision: str) -> Path | None:
    """config.json of `hf_repo` at `revision` in the Hugging Face cache, if there."""
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    hub = Path(os.environ.get("HF_HUB_CACHE", home / "hub"))
    repo_dir = hub / ("models--" + hf_repo.replace("/", "--"))
    ref = repo_dir / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    path = repo_dir / "snapshots" / commit / "config.json"
    return path if path.is_file() else None


def read_architecture(
    *, local_dir: str | None = None, hf_repo: str | None = None, hf_revision: str = "main"
) -> ModelArchitecture:
    """The architecture from config.json in `local_dir`, or in the Hugging Face
    cache for `hf_repo` (HF_HOME / HF_HUB_CACHE; nothing is downloaded).
    EstimateError when the file is not there or lacks a field."""
    if local_dir is not None:
        path: Path | None = Path(local_dir) / "config.json"
        where = f"{local_dir}"
    elif hf_repo is not None:
        path = _hf_cache_config(hf_repo, hf_revision)
        where = f"the Hugging Face cache for {hf_repo}@{hf_revision}"
    else:
        raise EstimateError("give local_dir or hf_repo")
    if path is None or not path.is_file():
        raise EstimateError(f"no config.json in {where}")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise EstimateError(f"{path} cannot be read as JSON: {e}") from None
    if not isinstance(config, dict):
        raise EstimateError(f"{path} does not hold a JSON object")
    return architecture_from_config(config)


def with_architecture(spec: ModelSpec) -> tuple[ModelSpec, str]:
    """`spec` with its architecture read from config.json (local_dir, else the
    Hugging Face cache), and "" ; or `spec` as it is and why none was read."""
    if spec.architecture is not None:
        return spec, ""
    try:
        arch = read_architecture(
            local_dir=spec.local_dir, hf_repo=spec.hf_repo, hf_revision=spec.hf_revision
        )
    except EstimateError as e:
        return spec, f"no architecture, so no memory estimates for its jobs: {e}"
    return msgspec.structs.replace(spec, architecture=arch), ""
