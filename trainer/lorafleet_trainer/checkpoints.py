"""Checkpoints, written: when one is due, the state copied off the training
(only the LoRA weights, never the base's) and written on a thread of its own,
in the layout of lorafleet_trainer.layout.

With a checkpoint_dir, one comes after every params.checkpoint_every_steps
optimizer steps and whenever params.checkpoint_every_s seconds passed since
the last one (`checkpoint_due`; never after the last step: the adapter is the
result then), and after the step during which the agent asked for one
(JobFile.checkpoint_now_path). Its "checkpoint" line is printed only once it
is complete.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import threading
import time
from pathlib import Path
from typing import Any, cast

from lorafleet_trainer.jobfile import JobFile
from lorafleet_trainer.layout import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    CHECKPOINT_FORMAT,
    CHECKPOINT_META,
    TMP_PREFIX,
    TRAINER_STATE,
    checkpoint_name,
)
from lorafleet_trainer.loop import Loop, Progress
from lorafleet_trainer.params import Params
from lorafleet_trainer.protocol import (
    CheckpointAsks,
    EnvironmentFailureError,
    Event,
    LineWriter,
)

#: The parameters a checkpoint's trajectory does not depend on: a "continue"
#: may change them (more or fewer checkpoints, another card's dtype).
FINGERPRINT_EXCLUDED = ("checkpoint_every_steps", "checkpoint_every_s", "dtype", "yield_to_serving")


def checkpoint_due(
    step: int, total_steps: int, every_steps: int, every_s: float, since_s: float
) -> bool:
    """Whether to checkpoint after optimizer step `step`: every `every_steps`
    steps, or once `every_s` seconds passed since the last checkpoint (or the
    start); never after the last step (the adapter is the result then)."""
    if step >= total_steps:
        return False
    if every_steps > 0 and step % every_steps == 0:
        return True
    return every_s > 0 and since_s >= every_s


def fingerprint_of(job: JobFile, total_steps: int) -> dict[str, Any]:
    """What a checkpoint's state depends on, as JSON: a "continue" must match
    it (the data plan is rebuilt from it, the optimizer's state assumes it)."""
    params = {
        k: v for k, v in dataclasses.asdict(job.params).items() if k not in FINGERPRINT_EXCLUDED
    }
    out = {
        "data_sha256": job.data_sha256,
        # None without an evaluation set: a checkpoint from before it matches.
        "eval_data_sha256": job.eval_data_sha256,
        "model": job.base.model,
        "total_steps": total_steps,
        **params,
    }
    return cast(dict[str, Any], json.loads(json.dumps(out)))


def fingerprint_differences(saved: Any, ours: dict[str, Any]) -> list[str]:
    """What differs between a checkpoint's fingerprint and this job's, by name."""
    if not isinstance(saved, dict):
        return ["its fingerprint is missing"]
    return [
        f"{k} {json.dumps(saved.get(k))} there, {json.dumps(ours.get(k))} here"
        for k in sorted(set(saved) | set(ours))
        if saved.get(k) != ours.get(k)
    ]


@dataclasses.dataclass
class Snapshot:
    """A checkpoint's content, copied off the training state at a step (so the
    training can go on while it is written)."""

    weights: dict[str, Any]
    state: dict[str, Any]
    adapter_config: str
    meta: dict[str, Any]


def _cpu_copy(obj: Any) -> Any:
    """`obj` with every tensor copied to the CPU (the optimizer updates its
    state in place: a reference would be written as it is some steps later)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_cpu_copy(v) for v in obj)
    return obj


def adapter_config_json(model: Any) -> str:
    """adapter_config.json as peft's save_pretrained writes it (sets as lists)."""
    config = model.peft_config["default"].to_dict()
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
    return json.dumps(config, indent=2, sort_keys=True)


def take_snapshot(
    loop: Loop, progress: Progress, epoch: int, index: int, meta: dict[str, Any]
) -> Snapshot:
    """The state after optimizer step progress.step, `index` steps into `epoch`'s plan."""
    import torch
    from peft import get_peft_model_state_dict

    weights = {
        k: v.detach().to("cpu", copy=True).contiguous()
        for k, v in get_peft_model_state_dict(loop.model).items()
    }
    rng: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if loop.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state_all()
    state = {
        "optimizer": _cpu_copy(loop.optimizer.state_dict()),
        "scheduler": _cpu_copy(loop.scheduler.state_dict()),
        "scaler": None if loop.scaler is None else _cpu_copy(loop.scaler.state_dict()),
        "rng": rng,
    }
    return Snapshot(
        weights,
        state,
        adapter_config_json(loop.model),
        {
            **meta,
            "format": CHECKPOINT_FORMAT,
            "step": progress.step,
            "epoch": epoch,
            "position": {"epoch": epoch, "index": index},
            "progress": dataclasses.asdict(progress),
        },
    )


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_checkpoint(parent: Path, snap: Snapshot) -> Path:
    """Write `snap` into parent/.tmp-step-N, synced, checkpoint.json last, then
    rename it to parent/step-N: a crash at any point leaves either no step-N or
    a complete one. Answers its path."""
    import torch
    from safetensors.torch import save_file

    name = checkpoint_name(int(snap.meta["step"]))
    tmp, final = parent / (TMP_PREFIX + name), parent / name
    if tmp.exists():  # a write of this step cut short, by a crash
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_file(snap.weights, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    torch.save(snap.state, tmp / TRAINER_STATE)
    (tmp / ADAPTER_CONFIG).write_text(snap.adapter_config, encoding="utf-8")
    files = {}
    for f in (ADAPTER_WEIGHTS, TRAINER_STATE, ADAPTER_CONFIG):
        # Readable by the agent, which may run as another user than the trainer.
        os.chmod(tmp / f, 0o644)
        _fsync(tmp / f)
        files[f] = (tmp / f).stat().st_size
    meta = {**snap.meta, "files": files, "time": round(time.time(), 3)}
    with (tmp / CHECKPOINT_META).open("w", encoding="utf-8") as fh:
        fh.write(json.dumps(meta, indent=2) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    _fsync(tmp)
    if final.exists():
        # The same step again (a run resumed from an earlier one passed it):
        # its state is the same; the old copy goes aside, then away.
        old = parent / (TMP_PREFIX + "old-" + name)
        if old.exists():
            shutil.rmtree(old)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    _fsync(parent)
    return final


class CheckpointWriter:
    """Writes snapshots on a thread of its own, one at a time, and prints each
    one's "checkpoint" line once it is complete. The training waits only for
    the copy of its state (`take_snapshot`) and, when checkpoints come faster
    than the disk takes them, for the previous write."""

    def __init__(self, parent: Path, lines: LineWriter) -> None:
        self.parent = parent
        self.lines = lines
        self.written = 0
        self._thread: threading.Thread | None = None
        self._failure: tuple[int, BaseException] | None = None

    def submit(self, snap: Snapshot) -> None:
        self.wait()
        self._thread = threading.Thread(
            target=self._write, args=(snap,), name="checkpoint-writer", daemon=True
        )
        self._thread.start()

    def _write(self, snap: Snapshot) -> None:
        try:
            path = write_checkpoint(self.parent, snap)
        except BaseException as e:
            self._failure = (int(snap.meta["step"]), e)
            return
        self.written += 1
        self.lines.emit(
            Event.CHECKPOINT, step=snap.meta["step"], path=str(path), epoch=snap.meta["epoch"]
        )

    def check(self) -> None:
        """Raise a finished write's failure (called every step: cheap)."""
        if self._thread is not None and not self._thread.is_alive():
            self.wait()

    def wait(self) -> None:
        """Wait for the write in flight; raise its failure: an OSError is the
        node's (its disk), EnvironmentFailureError; anything else as it is."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._failure is None:
            return
        step, e = self._failure
        self._failure = None
        if isinstance(e, OSError):
            raise EnvironmentFailureError(
                f"writing the checkpoint of step {step} into {self.parent} failed: "
                f"{type(e).__name__}: {e}"
            ) from e
        raise e


class Checkpointer:
    """When to checkpoint (`checkpoint_due`) and what (`take_snapshot`), after
    each optimizer step; the writing is the CheckpointWriter's."""

    def __init__(
        self,
        parent: Path,
        p: Params,
        total_steps: int,
        meta: dict[str, Any],
        lines: LineWriter,
        asked_path: Path | None = None,
    ) -> None:
        self.asks = CheckpointAsks(asked_path)
        self.every_steps = p.checkpoint_every_steps
        self.every_s = p.checkpoint_every_s
        self.total_steps = total_steps
        self.meta = meta
        self.writer = CheckpointWriter(parent, lines)
        self._last = time.monotonic()

    def after_step(self, loop: Loop, progress: Progress, epoch: int, index: int) -> None:
        self.writer.check()
        now = time.monotonic()
        asked = self.asks.asked() and progress.step < self.total_steps
        if asked or checkpoint_due(
            progress.step, self.total_steps, self.every_steps, self.every_s, now - self._last
        ):
            # The write before first: one snapshot in host memory at a time.
            self.writer.wait()
            self.writer.submit(take_snapshot(loop, progress, epoch, index, self.meta))
            self._last = now

    def close(self) -> None:
        self.writer.wait()


def open_checkpoint_dir(path: Path) -> None:
    """Create the checkpoint directory and clear what crashed writes left in it
    (.tmp-* directories: never checkpoints). Up front, so a disk that cannot
    take checkpoints fails the job before it trains."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        for d in path.glob(TMP_PREFIX + "*"):
            shutil.rmtree(d) if d.is_dir() else d.unlink()
    except OSError as e:
        raise EnvironmentFailureError(
            f"the checkpoint directory {path} cannot be written: {type(e).__name__}: {e}"
        ) from e
