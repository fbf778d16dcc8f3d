"""Resuming: the checkpoint or adapter a job starts from, found, checked
against the job and loaded.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Any

from lorafleet_trainer.checkpoints import fingerprint_differences, fingerprint_of
from lorafleet_trainer.jobfile import JobFile, Resume
from lorafleet_trainer.layout import (
    ADAPTER_WEIGHTS,
    CHECKPOINT_FORMAT,
    CHECKPOINT_META,
    TMP_PREFIX,
    TRAINER_STATE,
    is_temporary,
    newest_checkpoint,
)
from lorafleet_trainer.loop import Loop, Progress, Start
from lorafleet_trainer.protocol import BadInputError, LineWriter


def read_checkpoint_meta(d: Path) -> dict[str, Any]:
    """A complete checkpoint's checkpoint.json, checked (format, step, position,
    its files and their sizes); BadInputError saying what is wrong otherwise."""
    if is_temporary(d):
        raise BadInputError(
            f"{d} is a checkpoint that was still being written ({TMP_PREFIX}* directories "
            "are incomplete); resume from a step-* directory"
        )
    path = d / CHECKPOINT_META
    if not path.is_file():
        raise BadInputError(
            f"{d} has no {CHECKPOINT_META}: it is not a complete checkpoint (the trainer writes "
            "that file last)"
        )
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadInputError(f"{path} is not JSON: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != CHECKPOINT_FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else meta
        raise BadInputError(
            f"{path} has format {got!r}; this trainer reads format {CHECKPOINT_FORMAT}"
        )
    step, pos = meta.get("step"), meta.get("position")
    valid = (
        isinstance(step, int)
        and step >= 1
        and isinstance(pos, dict)
        and all(isinstance(pos.get(k), int) for k in ("epoch", "index"))
        and pos["epoch"] >= 1
        and 0 <= pos["index"] <= step
        and isinstance(meta.get("files"), dict)
        and isinstance(meta.get("progress"), dict)
    )
    if not valid:
        raise BadInputError(f"{path} lacks a valid step, position, progress or files list")
    for name, size in meta["files"].items():
        f = d / str(name)
        if not f.is_file() or f.stat().st_size != size:
            raise BadInputError(f"{f} is missing or not the {size} bytes {path} lists")
    return meta


def locate_checkpoint(d: Path) -> Path:
    """`d` itself when it holds checkpoint.json (or is a .tmp-* directory, to be
    refused by name); else the newest complete step-* directory inside it."""
    if not d.is_dir():
        raise BadInputError(f"the job's resume.dir {d} is not a directory")
    if is_temporary(d) or (d / CHECKPOINT_META).exists():
        return d
    # None: d itself, refused by read_checkpoint_meta (no checkpoint.json).
    return newest_checkpoint(d) or d


def resume_source(r: Resume) -> tuple[Path, dict[str, Any] | None]:
    """The directory to read and its checkpoint.json (None: a peft adapter
    directory, for "weights" only)."""
    adapter_dir = (
        r.mode == "weights"
        and not is_temporary(r.dir)
        and not (r.dir / CHECKPOINT_META).exists()
        and (r.dir / ADAPTER_WEIGHTS).is_file()
    )
    if adapter_dir:
        return r.dir, None
    d = locate_checkpoint(r.dir)
    return d, read_checkpoint_meta(d)


def load_adapter_weights(model: Any, d: Path, device: Any) -> None:
    """Copy d/adapter_model.safetensors into the LoRA weights of `model`;
    BadInputError when its modules or shapes differ (another rank or targets)."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file

    try:
        loaded = load_file(str(d / ADAPTER_WEIGHTS))
    except Exception as e:
        raise BadInputError(f"{d / ADAPTER_WEIGHTS} cannot be read: {type(e).__name__}: {e}") from e
    ours = {k: tuple(v.shape) for k, v in get_peft_model_state_dict(model).items()}
    theirs = {k: tuple(v.shape) for k, v in loaded.items()}
    if ours != theirs:
        raise BadInputError(
            f"the adapter in {d} does not fit this job's LoRA: it has {_lora_shape(theirs)}, "
            f"this job {_lora_shape(ours)}; params.rank and params.target_modules must be "
            "the ones it was trained with"
        )
    set_peft_model_state_dict(model, {k: v.to(device) for k, v in loaded.items()})


def _lora_shape(shapes: dict[str, tuple[int, ...]]) -> str:
    a = {s[0] for k, s in shapes.items() if k.endswith("lora_A.weight")}
    ranks = "/".join(str(r) for r in sorted(a)) or "no"
    modules = len([k for k in shapes if k.endswith("lora_A.weight")])
    return f"rank {ranks} on {modules} modules"


def restore_training_state(loop: Loop, d: Path, meta: dict[str, Any]) -> tuple[Progress, Any]:
    """The optimizer, LR scheduler and GradScaler states of checkpoint `d`
    into `loop`; answers its progress and its RNG states (restored last,
    just before the next step, by `restore_rng`)."""
    import torch

    state = torch.load(d / TRAINER_STATE, map_location="cpu", weights_only=True)
    loop.optimizer.load_state_dict(state["optimizer"])
    loop.scheduler.load_state_dict(state["scheduler"])
    if loop.scaler is not None and state.get("scaler"):
        loop.scaler.load_state_dict(state["scaler"])
    fields = {f.name for f in dataclasses.fields(Progress)}
    progress = Progress(**{k: v for k, v in meta["progress"].items() if k in fields})
    return progress, state["rng"]


def restore_rng(rng: dict[str, Any], device: Any) -> None:
    """The RNG states of the checkpoint: dropout draws on from where it was."""
    import torch

    python = rng["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))
    torch.set_rng_state(rng["torch"])
    if device.type == "cuda" and rng.get("cuda"):
        torch.cuda.set_rng_state_all(rng["cuda"])


def check_resume(job: JobFile, total_steps: int) -> tuple[Path, dict[str, Any] | None] | None:
    """The job's resume source (directory, checkpoint.json or None for a peft
    adapter directory), checked: for "continue", against this job's fingerprint."""
    if job.resume is None:
        return None
    d, meta = resume_source(job.resume)
    if job.resume.mode == "continue" and meta is not None:
        diffs = fingerprint_differences(meta.get("fingerprint"), fingerprint_of(job, total_steps))
        if diffs:
            raise BadInputError(
                f"the checkpoint {d} was written for other data or parameters: "
                f"{'; '.join(diffs)}; continue it with the same ones, or start from its "
                'weights (resume.mode "weights")'
            )
        if meta["step"] >= total_steps:
            raise BadInputError(f"the checkpoint {d} is at step {meta['step']}, the job's last")
    return d, meta


def apply_resume(
    loop: Loop,
    job: JobFile,
    source: tuple[Path, dict[str, Any] | None] | None,
    total_steps: int,
    lines: LineWriter,
) -> tuple[Start, Any]:
    """Load the resume source into `loop`: the adapter weights, and for
    "continue" the rest of the state; answers where training starts and the
    RNG states to restore just before it (None: the job's seed stands)."""
    if source is None or job.resume is None:
        return Start(), None
    d, meta = source
    load_adapter_weights(loop.model, d, loop.device)
    if job.resume.mode == "weights" or meta is None:
        lines.log(f"loaded the adapter weights of {d}; training from step 1")
        return Start(), None
    progress, rng = restore_training_state(loop, d, meta)
    pos = meta["position"]
    lines.log(f"resuming from {d}: step {meta['step']} of {total_steps}, epoch {pos['epoch']}")
    return Start(progress, pos["epoch"], pos["index"]), rng


def describe_resume(
    job: JobFile, source: tuple[Path, dict[str, Any] | None] | None, done_steps: int
) -> dict[str, Any] | None:
    """The training summary's account of what the run resumed from, if anything."""
    if source is None or job.resume is None:
        return None
    return {"mode": job.resume.mode, "dir": str(source[0]), "step": done_steps}
