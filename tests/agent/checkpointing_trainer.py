"""A trainer for the agent's checkpoint and resume tests: a real process that
speaks the trainer protocol (TrainerLine), the standard library and the
trainer's layout (lorafleet_trainer.layout, beside it in the job directory)
only, run by the agent as `LORAFLEET_AGENT_TRAINER=<this file>`.

    python checkpointing_trainer.py job.json

What the stand-in does not do (yet), through LORAFLEET_STANDIN_TEST_* knobs
(the agent passes LORAFLEET_STANDIN_* on to its trainer):
    STEPS          optimizer steps; default 20
    STEP_S         seconds per step; default 0.01
    EVERY          a checkpoint every this many steps (0: none); default 0
    CKPT_BYTES     bytes of a checkpoint's state file; default 4096
    EXIT           exit with this code at the end instead of saving (1, 2, 3)
    KILL_AT        SIGKILL itself at this step (the OOM killer's way)
A job id may say the last two itself, so that one agent runs them all:
`job-exit3` exits 3, `job-kill2` is killed at step 2.

First it logs what job.json's `resume` says and the files of its directory
("resume={...} files=[...]"). Each checkpoint is written as the real one is
(a temporary directory renamed `step-<NNNNNNNN>`, then the line), followed
by a log line "dirs=<n>": the checkpoint directories on disk at that moment.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from lorafleet_trainer.layout import CHECKPOINT_GLOB, TMP_PREFIX, checkpoint_name


def emit(event: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def knob(name: str, default: str) -> str:
    return os.environ.get(f"LORAFLEET_STANDIN_TEST_{name}") or default


def resume_note(job: dict[str, Any]) -> str:
    resume = job.get("resume")
    files: list[str] = []
    if resume:
        root = Path(resume["dir"])
        files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    return f"resume={json.dumps(resume)} files={json.dumps(files)}"


def checkpoint(root: Path, step: int, size: int) -> None:
    tmp = root / (TMP_PREFIX + checkpoint_name(step))
    tmp.mkdir()
    (tmp / "state.bin").write_bytes(os.urandom(size))
    (tmp / "trainer_state.json").write_text(json.dumps({"step": step}))
    final = root / checkpoint_name(step)
    tmp.rename(final)
    emit("checkpoint", step=step, path=str(final), epoch=1)
    dirs = sum(1 for _ in root.glob(CHECKPOINT_GLOB))
    emit("log", message=f"dirs={dirs}")


def main(argv: list[str]) -> int:
    job = json.loads(Path(argv[1]).read_text())
    steps, step_s = int(knob("STEPS", "20")), float(knob("STEP_S", "0.01"))
    every, size = int(knob("EVERY", "0")), int(knob("CKPT_BYTES", "4096"))
    kill_at, code = int(knob("KILL_AT", "0")), int(knob("EXIT", "0"))
    for part in job["job_id"].split("-"):
        if part.startswith("exit"):
            code = int(part[4:])
        elif part.startswith("kill"):
            kill_at = int(part[4:])
    emit("log", message=resume_note(job))
    emit("state", state="running", message=f"checkpointing trainer: {steps} steps")
    root = Path(job["checkpoint_dir"])
    for step in range(1, steps + 1):
        time.sleep(step_s)
        if step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        emit("step", step=step, steps=steps, loss=1.0 / step, learning_rate=1e-4,
             tokens_per_s=100.0, eta_s=step_s * (steps - step), peak_mib=1, epoch=1)  # fmt: skip
        if every and step % every == 0:
            checkpoint(root, step, size)
    if code:
        if code == 3:
            emit("error", message="CUDA error: an illegal memory access was encountered")
        print(f"exiting {code} as asked", file=sys.stderr)
        return code
    out = Path(job["out_dir"]) / "adapter"
    out.mkdir(parents=True)
    (out / "adapter_config.json").write_text("{}")
    emit("done", adapter_dir=str(out), base_dir=str(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
