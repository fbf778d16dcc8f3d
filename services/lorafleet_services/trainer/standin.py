"""The stand-in trainer: a real subprocess speaking the trainer's protocol.

    python standin.py job.json

It reads the same job file as the real trainer (see script.py) and
prints the same JSON lines on stdout (`TrainerLine` in
lorafleet_schemas.messages), without training anything: a falling loss, a
peak MiB, eval lines, and a small adapter directory whose bytes depend only
on the job id (`adapter_files`), so tests can compare what was delivered.
It imports only the standard library, like the real trainer.

Knobs (environment of the job):
    LORAFLEET_STANDIN_STEPS    optimizer steps; default: params.max_steps, else 5.
    LORAFLEET_STANDIN_STEP_S   seconds per step; default 0.02.
    LORAFLEET_STANDIN_FAIL_AT  at this step print an error line and exit 1.
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


def _steps(steps: int, epochs: int, step_s: float, fail_at: int) -> float | None:
    """The step and eval lines of a falling loss; the last loss, or None after
    failing at `fail_at` as asked."""
    per_epoch = max(1, -(-steps // epochs))
    loss = 2.5
    started = time.monotonic()
    for step in range(1, steps + 1):
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
            eta_s=round(elapsed / step * (steps - step), 3),
            peak_mib=100 + step,
            epoch=1 + (step - 1) // per_epoch,
        )
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
    if hang:
        # Ignore SIGTERM before saying "running": a cancel sent on that line
        # must meet a trainer that already ignores it.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    emit("state", state="running", message=f"stand-in: {steps} steps on {job['device']}")
    while hang:
        time.sleep(60)

    loss = _steps(steps, epochs, step_s, fail_at)
    if loss is None:
        return 1
    _save(job, loss, steps, records)
    if child_pid:
        os.kill(child_pid, signal.SIGTERM)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
