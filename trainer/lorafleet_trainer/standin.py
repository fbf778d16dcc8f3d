"""The stand-in trainer: a real subprocess speaking the trainer's protocol.

    python -m lorafleet_trainer.standin job.json

It reads the same job file and prints the same lines as the real trainer,
without training anything: a loss that depends only on the step, a peak
MiB, eval lines (with an evaluation set, the step's loss plus a thousandth
per record, so a test can tell which set was evaluated), TOKENS_PER_STEP
tokens a step, and a small adapter whose bytes depend only on the job id
(`adapter_files`); a DPO job's step and eval lines carry a margin and an
accuracy that depend only on the loss. Checkpoints and resume follow lorafleet_trainer.layout
and the real trainer's rules cheaply, so a resumed run prints the
uninterrupted one's lines. Standard library only, like the real trainer.
Its knobs (LORAFLEET_STANDIN_*): docs/deploy.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from lorafleet_trainer import probe
from lorafleet_trainer.jobfile import JobFile
from lorafleet_trainer.layout import (
    ADAPTER_CONFIG,
    ADAPTER_DIR,
    ADAPTER_WEIGHTS,
    CHECKPOINT_FORMAT,
    CHECKPOINT_META,
    TMP_PREFIX,
    checkpoint_name,
    is_temporary,
    newest_checkpoint,
)
from lorafleet_trainer.params import Params
from lorafleet_trainer.protocol import BadInputError, CheckpointAsks, Event, ExitCode, LineWriter

#: Bytes of the stand-in adapter's weights file.
ADAPTER_WEIGHTS_BYTES = 64 * 1024
#: Tokens each stand-in step counts as trained on.
TOKENS_PER_STEP = 100


def adapter_files(job_id: str) -> dict[str, bytes]:
    """The stand-in adapter directory's files: deterministic from the job id."""
    seed = hashlib.sha256(f"lorafleet-standin:{job_id}".encode()).digest()
    blocks = bytearray()
    counter = 0
    while len(blocks) < ADAPTER_WEIGHTS_BYTES:
        blocks += hashlib.sha256(seed + counter.to_bytes(8, "big")).digest()
        counter += 1
    config = {
        "peft_type": "LORA",
        "r": 8,
        "lora_alpha": 16,
        "target_modules": ["q_proj", "v_proj"],
        "standin": True,
        "job_id": job_id,
    }
    return {
        ADAPTER_CONFIG: json.dumps(config, indent=2, sort_keys=True).encode(),
        ADAPTER_WEIGHTS: bytes(blocks[:ADAPTER_WEIGHTS_BYTES]),
        probe.PROBE_FILE: json.dumps(probe_reference(seed), sort_keys=True).encode(),
    }


def probe_reference(seed: bytes) -> dict[str, Any]:
    """A probe reference in the trainer's form (lorafleet_trainer.probe),
    made up from `seed`: an engine stand-in (tests/gateway/engine.py) answers
    the probe with it, so the agent's load and confirm run unchanged."""

    def continuation(salt: bytes) -> dict[str, list[Any]]:
        digest = hashlib.sha256(seed + salt).digest()
        ids = [100 + b for b in digest[: probe.PROBE_TOKENS]]
        return {"ids": ids, "logprobs": [-b / 256 for b in digest[: probe.PROBE_TOKENS]]}

    token_ids = list(range(1, len(probe.PROBE_TEXT.split()) + 1))
    return {
        "text": probe.PROBE_TEXT, "dtype": probe.PROBE_DTYPE, "token_ids": token_ids,
        "adapter": continuation(b"adapter"), "base": continuation(b"base"),
    }  # fmt: skip


def gguf_bytes(job_id: str) -> bytes:
    """A stand-in GGUF file (not a converted adapter): deterministic from the job id."""
    body = hashlib.sha256(f"lorafleet-standin-gguf:{job_id}".encode()).digest() * 512
    return b"GGUF" + body


def _int_env(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    return int(raw) if raw else default


def _start_child() -> int:
    """LORAFLEET_STANDIN_CHILD: a child that sleeps (the agent must kill the group)."""
    if os.environ.get("LORAFLEET_STANDIN_CHILD") != "1":
        return 0
    child = subprocess.Popen(
        [sys.executable, "-c", "import time\nwhile True: time.sleep(60)"],
        stdin=subprocess.DEVNULL,
    )
    return child.pid


class Checkpoints:
    """The checkpoint side of the real trainer's protocol (see the module docstring)."""

    def __init__(self, job: JobFile, steps: int, lines: LineWriter) -> None:
        self.dir = job.checkpoint_dir
        self.every_steps = job.params.checkpoint_every_steps
        self.every_s = job.params.checkpoint_every_s
        self.steps = steps
        self.job_id = job.job_id
        self.fingerprint = {"data_sha256": job.data_sha256, "total_steps": steps}
        self.lines = lines
        self.asks = CheckpointAsks(job.checkpoint_now_path)
        self._last = time.monotonic()
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)

    def after_step(self, step: int, epoch: int, index: int) -> None:
        if self.dir is None or step >= self.steps:
            return
        now = time.monotonic()
        by_steps = self.every_steps > 0 and step % self.every_steps == 0
        by_time = self.every_s > 0 and now - self._last >= self.every_s
        if not (self.asks.asked() or by_steps or by_time):
            return
        self._last = now
        name = checkpoint_name(step)
        tmp, final = self.dir / (TMP_PREFIX + name), self.dir / name
        tmp.mkdir(parents=True, exist_ok=True)
        weights = hashlib.sha256(f"{self.job_id}:{step}".encode()).digest() * 128
        (tmp / ADAPTER_WEIGHTS).write_bytes(weights)
        meta = {
            "job_id": self.job_id,
            "fingerprint": self.fingerprint,
            "format": CHECKPOINT_FORMAT,
            "step": step,
            "epoch": epoch,
            "position": {"epoch": epoch, "index": index},
            "progress": {"step": step, "tokens": step * TOKENS_PER_STEP},
            "files": {ADAPTER_WEIGHTS: len(weights)},
            "time": round(time.time(), 3),
            "standin": True,
        }
        (tmp / CHECKPOINT_META).write_text(json.dumps(meta, indent=2) + "\n")
        if final.exists():  # the same step again, after a resume from an earlier one
            old = self.dir / (TMP_PREFIX + "old-" + name)
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old)
        else:
            tmp.rename(final)
        self.lines.emit(Event.CHECKPOINT, step=step, path=str(final), epoch=epoch)


def _checkpoint_meta(d: Path) -> dict[str, Any]:
    if d.is_dir() and not (d / CHECKPOINT_META).exists() and not is_temporary(d):
        d = newest_checkpoint(d) or d
    if is_temporary(d):
        raise BadInputError(f"{d} is a checkpoint that was still being written")
    try:
        meta = json.loads((d / CHECKPOINT_META).read_text())
    except (OSError, ValueError):
        raise BadInputError(f"{d} has no valid {CHECKPOINT_META}") from None
    if not isinstance(meta, dict) or meta.get("format") != CHECKPOINT_FORMAT:
        raise BadInputError(f"{d}/{CHECKPOINT_META} is not format {CHECKPOINT_FORMAT}")
    return meta


def resume_step(job: JobFile, lines: LineWriter) -> tuple[int, int]:
    """The step a resume goes on after and the tokens trained by then: a
    checkpoint's for "continue", (0, 0) otherwise."""
    if job.resume is None:
        return 0, 0
    d = job.resume.dir
    if job.resume.mode == "weights":
        if (d / ADAPTER_WEIGHTS).is_file() and not is_temporary(d):
            return 0, 0
        _checkpoint_meta(d)
        return 0, 0
    meta = _checkpoint_meta(d)
    step = int(meta["step"])
    lines.emit(Event.LOG, message=f"resuming from {d}: step {step}", level="info")
    return step, int(meta.get("progress", {}).get("tokens", 0))


def _dpo(loss: float, prefix: str = "") -> dict[str, float]:
    """A DPO line's numbers, from the stand-in's loss."""
    margin = round(2.5 - loss, 6)
    return {f"{prefix}rewards_chosen": margin / 2, f"{prefix}rewards_rejected": -margin / 2,
            f"{prefix}margin": margin, f"{prefix}accuracy": 1.0}  # fmt: skip


def _steps(
    lines: LineWriter, steps: int, params: Params, step_s: float, fail_at: int, first: int,
    ckpt: Checkpoints, eval_offset: float,
) -> float | None:  # fmt: skip
    """The step and eval lines of a falling loss, from step `first` (the eval
    loss `eval_offset` above it); the last loss, or None after failing at
    `fail_at` as asked."""
    per_epoch = max(1, -(-steps // params.epochs))
    dpo = params.method == "dpo"
    loss = 2.5 * 0.9 ** (first - 1)
    started = time.monotonic()
    for step in range(first, steps + 1):
        time.sleep(step_s)
        if step == fail_at:
            print(f"stand-in: failing at step {step} as asked", file=sys.stderr)
            lines.emit(Event.ERROR, message=f"stand-in trainer failed at step {step} (as asked)")
            return None
        loss *= 0.9
        elapsed = time.monotonic() - started
        epoch = 1 + (step - 1) // per_epoch
        lines.emit(
            Event.STEP,
            step=step,
            steps=steps,
            loss=round(loss, 6),
            learning_rate=2e-4 * (1 - (step - 1) / steps),
            tokens_per_s=1000.0,
            eta_s=round(elapsed / (step - first + 1) * (steps - step), 3),
            peak_mib=100 + step,
            epoch=epoch,
            **(_dpo(loss) if dpo else {}),
        )
        ckpt.after_step(step, epoch, step - (epoch - 1) * per_epoch)
        if step % per_epoch == 0 or step == steps:
            more = _dpo(loss, "eval_") if dpo else {}
            eval_loss = round(loss + eval_offset, 6)
            lines.emit(Event.EVAL, step=step, epoch=epoch, eval_loss=eval_loss, **more)
    return loss


def _save(
    lines: LineWriter, job: JobFile, loss: float, steps: int, records: int, tokens: int
) -> None:
    lines.emit(Event.STATE, state="saving", message="writing the stand-in adapter")
    out = job.out_dir / ADAPTER_DIR
    out.mkdir(parents=True, exist_ok=True)
    for name, content in adapter_files(job.job_id).items():
        (out / name).write_bytes(content)
    base_dir = job.base.local_dir or str(job.out_dir / "base")
    lines.emit(
        Event.DONE,
        adapter_dir=str(out),
        base_dir=base_dir,
        summary={
            "final_loss": round(loss, 6),
            "steps": steps,
            "records": records,
            "tokens_seen": tokens,
        },
    )


def _count_records(path: Path, sha256: str, key: str) -> int:
    """The non-blank lines of a data file whose sha256 must be the job's `key`'s."""
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != sha256:
        raise BadInputError(f"the {key} file's sha256 differs from the job's {key}_sha256")
    return sum(1 for line in data.splitlines() if line.strip())


def main(argv: list[str]) -> int:
    lines = LineWriter(sys.stdout)
    if len(argv) != 2:
        print("usage: python -m lorafleet_trainer.standin job.json", file=sys.stderr)
        return ExitCode.BAD_INPUT
    try:
        job = JobFile.read(Path(argv[1]))
    except BadInputError as e:
        lines.emit(Event.ERROR, message=str(e))
        return ExitCode.BAD_INPUT
    steps = _int_env("LORAFLEET_STANDIN_STEPS", job.params.max_steps or 5)
    step_s = float(os.environ.get("LORAFLEET_STANDIN_STEP_S") or 0.02)
    fail_at = _int_env("LORAFLEET_STANDIN_FAIL_AT", 0)
    fail_exit = _int_env("LORAFLEET_STANDIN_FAIL_EXIT", ExitCode.JOB_FAILED)
    hang = os.environ.get("LORAFLEET_STANDIN_HANG") == "1"

    child_pid = _start_child()
    lines.emit(Event.LOG, message=f"pid={os.getpid()} child_pid={child_pid}", level="info")
    # Libraries print to stdout too: the agent must skip what is not the protocol.
    print("stand-in: a stdout line that is not the protocol", flush=True)
    lines.emit(Event.STATE, state="preparing", message="stand-in trainer: no weights to load")

    try:
        records = _count_records(job.data_path, job.data_sha256, "data")
        eval_records = 0
        if job.eval_data_path is not None and job.eval_data_sha256 is not None:
            eval_records = _count_records(job.eval_data_path, job.eval_data_sha256, "eval_data")
    except BadInputError as e:
        lines.emit(Event.ERROR, message=str(e))
        return ExitCode.BAD_INPUT
    held = f"; {eval_records} in the evaluation set" if eval_records else ""
    lines.emit(Event.LOG, message=f"{records} records{held}", level="info")
    try:
        done, tokens_before = resume_step(job, lines)
    except BadInputError as e:
        lines.emit(Event.ERROR, message=str(e))
        return ExitCode.BAD_INPUT
    ckpt = Checkpoints(job, steps, lines)
    if hang:
        # Ignore SIGTERM before saying "running": a cancel sent on that line
        # must meet a trainer that already ignores it.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    lines.emit(Event.STATE, state="running", message=f"stand-in: {steps} steps on {job.device}")
    while hang:
        time.sleep(60)

    loss = _steps(
        lines, steps, job.params, step_s, fail_at, done + 1, ckpt, eval_records / 1000
    )  # fmt: skip
    if loss is None:
        return fail_exit
    _save(lines, job, loss, steps, records, tokens_before + (steps - done) * TOKENS_PER_STEP)
    if child_pid:
        os.kill(child_pid, signal.SIGTERM)
    return ExitCode.DONE


if __name__ == "__main__":
    sys.exit(main(sys.argv))
