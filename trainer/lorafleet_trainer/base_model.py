"""The base model: its directory (a local one, or the Hugging Face cache),
its module names checked, its weights loaded with a fresh LoRA adapter.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any, cast

from lorafleet_trainer import memory, plans
from lorafleet_trainer.guard import Sizing
from lorafleet_trainer.jobfile import Base, JobFile
from lorafleet_trainer.loop import Loop, prepare_training, torch_dtype
from lorafleet_trainer.plans import MemoryPlan
from lorafleet_trainer.protocol import BadInputError, EnvironmentFailureError, TrainingFailureError

HF_PATTERNS = [
    "*.safetensors",
    "*.safetensors.index.json",
    "*.json",
    "*.jinja",
    "*.model",
    "*.txt",
    "*.tiktoken",
    "tokenizer*",
]


def resolve_base(base: Base, offline: bool) -> Path:
    """The directory holding the base's config, tokenizer and safetensors."""
    if base.local_dir is not None:
        d = Path(base.local_dir)
        if not (d / "config.json").is_file():
            raise BadInputError(f"base.local_dir {d} has no config.json")
    else:
        from huggingface_hub import snapshot_download

        if base.hf_repo is None:
            raise BadInputError("the job's base needs exactly one of hf_repo and local_dir")
        try:
            d = Path(
                snapshot_download(
                    repo_id=base.hf_repo,
                    revision=base.hf_revision,
                    allow_patterns=HF_PATTERNS,
                    local_files_only=offline,
                )
            )
        except Exception as e:
            where = "the node's Hugging Face cache" if offline else "the Hugging Face Hub"
            said = f"{base.hf_repo}@{base.hf_revision} is not in {where}: {type(e).__name__}: {e}"
            # Missing from this node's cache is this node's lack (another
            # node may hold it); missing from the Hub, the job's own.
            raise (EnvironmentFailureError if offline else TrainingFailureError)(said) from e
    if not any(d.glob("*.safetensors")):
        raise BadInputError(f"no *.safetensors weights in {d}; only safetensors are read")
    # The trainer runs as the engines' user; weights saved by another user
    # (transformers writes them 0600) would otherwise fail deep inside
    # safetensors with a misleading "No such file or directory".
    unreadable = sorted(p.name for p in d.iterdir() if p.is_file() and not os.access(p, os.R_OK))
    if unreadable:
        raise TrainingFailureError(
            f"the trainer runs as uid {os.getuid()} and cannot read "
            f"{', '.join(unreadable[:5])} in {d}; make the base's files readable by the "
            f"engines' user (chmod -R a+rX {d})"
        )
    return d


def check_target_modules(base_dir: Path, target_modules: list[str] | str) -> None:
    """Refuse module names the base does not have, before its weights load.

    The model is built on torch's meta device from its config (no memory, no
    weights) only to list its modules; peft matches a name against the end of
    each module's dotted path.
    """
    if isinstance(target_modules, str):
        return
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(base_dir), trust_remote_code=False)
    with torch.device("meta"):
        skeleton = cast(Any, AutoModelForCausalLM).from_config(config, trust_remote_code=False)
    names = [n for n, _ in skeleton.named_modules() if n]
    missing = [t for t in target_modules if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        linear = sorted(
            {
                n.rsplit(".", 1)[-1]
                for n, m in skeleton.named_modules()
                if isinstance(m, torch.nn.Linear)
            }
        )
        raise BadInputError(
            f"params.target_modules names {missing}, which this model does not have; "
            f'its linear layers are {linear} (or use "all-linear")'
        )


def choose_memory_plan(
    job: JobFile, base_dir: Path, device: Any, longest: int, process_mib: int
) -> tuple[MemoryPlan, Sizing | None]:
    """The job's memory plan (lorafleet_trainer.plans.choose_plan) by the
    estimate of the base's config.json for rows of `longest` tokens, within
    gpu_memory_mib, with the process's own `process_mib` on the CPU; and
    what the guard estimates with. A base the estimate does not know gets
    every layer checkpointed (and the frugal heap) when the job has a budget
    (the safe side), none without, and no sizing."""
    import json

    p = job.params
    try:
        config = json.loads((base_dir / "config.json").read_text(encoding="utf-8"))
        arch = memory.architecture_from_config(config)
        choice = plans.choose_plan(arch, p, device.type, longest, job.gpu_memory_mib, process_mib)
        return choice, Sizing(arch, p, device.type, process_mib, longest)
    except memory.EstimateError as e:
        budget = job.gpu_memory_mib is not None
        setting = p.gradient_checkpointing
        every = int(setting) if isinstance(setting, bool) else int(budget)
        plan = memory.Plan(every, budget and device.type == "cpu")
        words = plans.plan_words(plan, 0, p.batch_size, device.type)
        return MemoryPlan(plan, 0, 0, f"no memory estimate ({e})", words), None


def library_versions() -> dict[str, str]:
    from importlib import metadata

    out = {"python": sys.version.split()[0]}
    for name in ("torch", "transformers", "peft", "accelerate", "safetensors"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "missing"
    return out


def _load_kwargs(dtype: Any) -> dict[str, Any]:
    """from_pretrained's dtype argument: `dtype` since transformers 4.56, `torch_dtype` before."""
    import transformers

    major, minor = (int(x) for x in re.findall(r"\d+", transformers.__version__)[:2])
    key = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    return {key: dtype}


def load_for_training(
    job: JobFile, base_dir: Path, dtype: str, device: Any, total_steps: int, checkpoint_every: int
) -> Loop:
    """The base weights with a fresh LoRA adapter, its optimizer and schedule,
    gradient checkpointing every `checkpoint_every`-th layer (0: none)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(base_dir),
        use_safetensors=True,
        trust_remote_code=False,
        **_load_kwargs(torch_dtype(dtype)),
        # Straight onto the card: no full copy of the weights in host memory.
        **({"device_map": {"": str(device)}} if device.type == "cuda" else {}),
    )
    model.config.use_cache = False
    loop = prepare_training(model, job.params, dtype, device, total_steps, checkpoint_every)
    # The adapter (and each checkpoint's) names its base as the catalog does,
    # not by this node's path.
    loop.model.peft_config["default"].base_model_name_or_path = (
        job.base.hf_repo or job.base.local_dir
    )
    return loop
