"""The stand-in trainer: a real subprocess speaking the trainer's protocol.

    python standin.py job.json

It reads the same job file as the real trainer (see script.py) and
prints the same JSON lines on stdout (`TrainerLine` in
lorafleet_schemas.messages), without training anything: a falling loss, a
peak MiB, eval lines, and a small adapter directory whose bytes depend only
on the job id (`adapter_files`), so tests can compare what was delivered.
It imports only the standard library, like the real trainer.

Checkpoints and resume follow the real trainer's protocol, cheaply: with
the job's `checkpoint_dir` and params.checkpoint_every_steps (or
checkpoint_every_s) it writes `<checkpoint_dir>/.tmp-step-N/` (a small
adapter_model.safetensors stand-in, then checkpoint.json: format, step,
epoch, position, fingerprint, time, files), renames it to `step-NNNNNNNN`
and prints {"event": "checkpoint", "step", "path", "epoch"}; never after
the last step. `resume` {"dir", "mode"}: "continue" reads dir's
checkpoint.json (a .tmp-* directory, or one without a valid checkpoint.json,
is refused: exit 2) and goes on with the step after its own; the losses
depend only on the step, so a resumed run prints the uninterrupted one's.
"weights" needs a checkpoint or an adapter_model.safetensors in dir and
starts from step 1. A dir holding step-* directories means its newest
complete one.

Knobs (environment of the job):
    LORAFLEET_STANDIN_STEPS    optimizer steps; default: params.max_steps, else 5.
    LORAFLEET_STANDIN_STEP_S   seconds per step; default 0.02.
    LORAFLEET_STANDIN_FAIL_AT  at this step print an error line and exit 1.
    LORAFLEET_STANDIN_FAIL_EXIT  the exit status of that failure; default 1
                               (3: a failure of the node, retryable).
    LORAFLEET_STANDIN_HANG     "1": once running, ignore SIGTERM and sleep
                               forever (the agent's SIGKILL path).
    LORAFLEET_STANDIN_CHILD    "1": start a child process that sleeps too
                               (the agent must kill the whole group).
Its first log line names its pids: "pid=<pid> child_pid=<pid or 0>"; the
next stdout line is not JSON (as library chatter would be), for the agent to skip.
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

#: Bytes of the stand-in adapter's weights file.
ADAPTER_WEIGHTS_BYTES = 64 * 1024


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
        "adapter_config.json": json.dumps(config, indent=2, sort_keys=True).encode(),
        "adapter_model.safetensors": bytes(blocks[:ADAPTER_WEIGHTS_BYTES]),
    }


def gguf_bytes(job_id: str) -> bytes:
    """A stand-in GGUF file (not a converted adapter): deterministic from the job id."""
    body = hashlib.sha256(f"lorafleet-standin-gguf:{job_id}".encode()).digest() * 512
    return b"GGUF" + body


def emit(event: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


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


CHECKPOINT_FORMAT = 1
TMP_PREFIX = ".tmp-"


class StandinInputError(Exception):
    """A resume the stand-in cannot use: exit 2, as the real trainer's bad input."""


class Checkpoints:
    """The checkpoint side of the real trainer's protocol (see the module docstring)."""

    def __init__(self, job: dict[str, Any], steps: int) -> None:
        params = job.get("params") or {}
        d = job.get("checkpoint_dir")
        self.dir = Path(d) if d else None
        self.every_steps = int(params.get("checkpoint_every_steps") or 0)
        self.every_s = float(params.get("checkpoint_every_s", 600.0) or 0)
        self.steps = steps
        self.job_id = str(job["job_id"])
        self.fingerprint = {"data_sha256": job["data_sha256"], "total_steps": steps}
        self._last = time.monotonic()
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)

    def after_step(self, step: int, epoch: int, index: int) -> None:
        if self.dir is None or step >= self.steps:
            return
        now = time.monotonic()
        by_steps = self.every_steps > 0 and step % self.every_steps == 0
        if not (by_steps or (self.every_s > 0 and now - self._last >= self.every_s)):
            return
        self._last = now
        name = f"step-{step:08d}"
        tmp, final = self.dir / (TMP_PREFIX + name), self.dir / name
        tmp.mkdir(parents=True, exist_ok=True)
        weights = hashlib.sha256(f"{self.job_id}:{step}".encode()).digest() * 128
        (tmp / "adapter_model.safetensors").write_bytes(weights)
        meta = {
            "job_id": self.job_id,
            "fingerprint": self.fingerprint,
            "format": CHECKPOINT_FORMAT,
            "step": step,
            "epoch": epoch,
            "position": {"epoch": epoch, "index": index},
            "progress": {"step": step},
            "files": {"adapter_model.safetensors": len(weights)},
            "time": round(time.time(), 3),
            "standin": True,
        }
        (tmp / "checkpoint.json").write_text(json.dumps(meta, indent=2) + "\n")
        if final.exists():  # the same step again, after a resume from an earlier one
            old = self.dir / (TMP_PREFIX + "old-" + name)
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old)
        else:
            tmp.rename(final)
        emit("checkpoint", step=step, path=str(final), epoch=epoch)


def _checkpoint_meta(d: Path) -> dict[str, Any]:
    if d.is_dir() and not (d / "checkpoint.json").exists() and not d.name.startswith(TMP_PREFIX):
        newest = sorted(c for c in d.glob("step-*") if (c / "checkpoint.json").is_file())
        d = newest[-1] if newest else d
    if d.name.startswith(TMP_PREFIX):
        raise StandinInputError(f"{d} is a checkpoint that was still being written")
    try:
        meta = json.loads((d / "checkpoint.json").read_text())
    except (OSError, ValueError):
        raise StandinInputError(f"{d} has no valid checkpoint.json") from None
    if not isinstance(meta, dict) or meta.get("format") != CHECKPOINT_FORMAT:
        raise StandinInputError(f"{d}/checkpoint.json is not format {CHECKPOINT_FORMAT}")
    return meta


def resume_step(job: dict[str, Any]) -> int:
    """The step a resume goes on after: a checkpoint's for "continue", 0 otherwise."""
    resume = job.get("resume")
    if not resume:
        return 0
    d = Path(resume["dir"])
    if resume["mode"] == "weights":
        if (d / "adapter_model.safetensors").is_file() and not d.name.startswith(TMP_PREFIX):
            return 0
        _checkpoint_meta(d)
        return 0
    step = int(_checkpoint_meta(d)["step"])
    emit("log", message=f"resuming from {d}: step {step}", level="info")
    return step


def _steps(
    steps: int, epochs: int, step_s: float, fail_at: int, first: int, ckpt: Checkpoints
) -> float | None:
    """The step and eval lines of a falling loss, from step `first`; the last
    loss, or None after failing at `fail_at` as asked."""
    per_epoch = max(1, -(-steps // epochs))
    loss = 2.5 * 0.9 ** (first - 1)
    started = time.monotonic()
    for step in range(first, steps + 1):
        time.sleep(step_s)
        if step == fail_at:
            print(f"stand-in: failing at step {step} as asked", file=sys.stderr)
            emit("error", message=f"stand-in trainer failed at step {step} (as asked)")
            return None
        loss *= 0.9
        elapsed = time.monotonic() - started
        emit(
            "step",
            step=step,
            steps=steps,
            loss=round(loss, 6),
            learning_rate=2e-4 * (1 - (step - 1) / steps),
            tokens_per_s=1000.0,
            eta_s=round(elapsed / (step - first + 1) * (steps - step), 3),
            peak_mib=100 + step,
            epoch=1 + (step - 1) // per_epoch,
        )
        epoch = 1 + (step - 1) // per_epoch
        ckpt.after_step(step, epoch, step - (epoch - 1) * per_epoch)
        if step % per_epoch == 0 or step == steps:
            emit("eval", step=step, epoch=1 + (step - 1) // per_epoch, eval_loss=round(loss, 6))
    return loss


def _save(job: dict[str, Any], loss: float, steps: int, records: int) -> None:
    emit("state", state="saving", message="writing the stand-in adapter")
    out = Path(job["out_dir"]) / "adapter"
    out.mkdir(parents=True, exist_ok=True)
    for name, content in adapter_files(job["job_id"]).items():
        (out / name).write_bytes(content)
    base = job.get("base") or {}
    base_dir = base.get("local_dir") or str(Path(job["out_dir"]) / "base")
    emit(
        "done",
        adapter_dir=str(out),
        base_dir=base_dir,
        summary={"final_loss": round(loss, 6), "steps": steps, "records": records},
    )


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: standin.py job.json", file=sys.stderr)
        return 2
    job = json.loads(Path(argv[1]).read_text())
    params = job.get("params") or {}
    steps = _int_env("LORAFLEET_STANDIN_STEPS", int(params.get("max_steps") or 5))
    step_s = float(os.environ.get("LORAFLEET_STANDIN_STEP_S") or 0.02)
    fail_at = _int_env("LORAFLEET_STANDIN_FAIL_AT", 0)
    fail_exit = _int_env("LORAFLEET_STANDIN_FAIL_EXIT", 1)
    hang = os.environ.get("LORAFLEET_STANDIN_HANG") == "1"
    epochs = max(1, int(params.get("epochs") or 1))

    child_pid = _start_child()
    emit("log", message=f"pid={os.getpid()} child_pid={child_pid}", level="info")
    # Libraries print to stdout too: the agent must skip what is not the protocol.
    print("stand-in: a stdout line that is not the protocol", flush=True)
    emit("state", state="preparing", message="stand-in trainer: no weights to load")

    data = Path(job["data_path"]).read_bytes()
    if hashlib.sha256(data).hexdigest() != job["data_sha256"]:
        emit("error", message="the data file's sha256 differs from the job's data_sha256")
        return 2
    records = sum(1 for line in data.splitlines() if line.strip())
    emit("log", message=f"{records} records", level="info")
    try:
        done = resume_step(job)
    except StandinInputError as e:
        emit("error", message=str(e))
        return 2
    ckpt = Checkpoints(job, steps)
    if hang:
        # Ignore SIGTERM before saying "running": a cancel sent on that line
        # must meet a trainer that already ignores it.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    emit("state", state="running", message=f"stand-in: {steps} steps on {job['device']}")
    while hang:
        time.sleep(60)

    loss = _steps(steps, epochs, step_s, fail_at, done + 1, ckpt)
    if loss is None:
        return fail_exit
    _save(job, loss, steps, records)
    if child_pid:
        os.kill(child_pid, signal.SIGTERM)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
