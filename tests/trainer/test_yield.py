"""The trainer yields between steps while the agent's pause file exists
(lorafleet_trainer.protocol.PauseGate), and its paused time is no step's."""

from __future__ import annotations

import contextlib
import io
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from lorafleet_schemas.messages import TrainerLine, TrainerYield
from lorafleet_trainer.jobfile import JobFile
from lorafleet_trainer.protocol import PAUSE_LEASE_S, LineWriter, PauseGate
from tests.trainer.harness import ndjson, qa_records, start_trainer, write_job

_strict: msgspec.json.Decoder[TrainerLine] = msgspec.json.Decoder(TrainerLine)


def _lines(out: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(x) for x in out.getvalue().splitlines()]


def test_no_pause_file_no_wait_and_no_line(tmp_path: Path) -> None:
    out = io.StringIO()
    gate = PauseGate(tmp_path / "pause", LineWriter(out))
    assert gate.wait(3) == 0.0
    assert out.getvalue() == ""


def test_a_pause_holds_until_the_file_goes_and_says_why(tmp_path: Path) -> None:
    pause = tmp_path / "pause"
    pause.write_text("http://e:8000 has 2 running, 1 waiting\n")
    out = io.StringIO()
    looks: list[float] = []

    def sleep(s: float) -> None:  # the third look finds the file gone
        looks.append(s)
        if len(looks) == 3:
            pause.unlink()

    ticks = iter([10.0, 12.5])
    gate = PauseGate(pause, LineWriter(out), sleep=sleep, clock=lambda: next(ticks))
    assert gate.wait(7) == 2.5
    assert len(looks) == 3
    lines = _lines(out)
    for x in lines:  # what the agent decodes, strictly
        assert isinstance(_strict.decode(json.dumps(x)), TrainerYield)
    assert lines == [
        {"event": "yield", "state": "paused", "step": 7,
         "cause": "http://e:8000 has 2 running, 1 waiting"},
        {"event": "yield", "state": "resumed", "step": 7, "paused_s": 2.5},
    ]  # fmt: skip


def test_a_stale_pause_file_is_not_obeyed(tmp_path: Path) -> None:
    """An agent that stopped touching its pause file holds no trainer."""
    pause = tmp_path / "pause"
    pause.write_text("busy\n")
    old = time.time() - PAUSE_LEASE_S - 5
    os.utime(pause, (old, old))
    out = io.StringIO()
    assert PauseGate(pause, LineWriter(out)).wait(1) == 0.0
    assert out.getvalue() == ""


def test_the_job_file_carries_the_pause_path(tmp_path: Path) -> None:
    job = write_job(tmp_path, tmp_path, data="", pause_path=str(tmp_path / "pause"))
    parsed = JobFile.read(job)
    assert parsed.pause_path == tmp_path / "pause"
    assert JobFile.parse(json.loads(parsed.to_json())).pause_path == tmp_path / "pause"


def thread_policies(pid: int) -> dict[int, int]:
    """Thread id -> its scheduling policy, for the threads of `pid` alive now
    (one may end between the listing and its read)."""
    out: dict[int, int] = {}
    for tid in map(int, os.listdir(f"/proc/{pid}/task")):
        with contextlib.suppress(ProcessLookupError):
            out[tid] = os.sched_getscheduler(tid)
    return out


@pytest.mark.slow
def test_the_real_trainer_waits_between_steps_and_goes_on(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    """Paused before its first step: no step until the file goes; then every
    step and the adapter."""
    pause = tmp_path / "job" / "pause"
    job = write_job(
        tmp_path / "job", tiny_model("llama"), data=ndjson(qa_records()),
        params={"rank": 4, "max_steps": 4, "batch_size": 4, "max_seq_len": 48},
        pause_path=str(pause),
    )  # fmt: skip
    pause.write_text("the engine is busy\n")
    seen: list[dict[str, Any]] = []
    held_s = 3.0
    with start_trainer(job) as p:
        assert p.stdout is not None
        for raw in p.stdout:
            seen.append(json.loads(raw))
            if seen[-1]["event"] == "yield":
                break
        # On the CPU a yielding trainer's every thread runs at SCHED_IDLE.
        policies = thread_policies(p.pid)
        assert set(policies.values()) == {os.SCHED_IDLE}, policies
        threading.Timer(held_s, pause.unlink).start()
        seen += [json.loads(raw) for raw in p.stdout]
        assert p.wait(timeout=120) == 0, seen[-3:]
    events = [x["event"] for x in seen]
    first_step = events.index("step")
    assert events.index("yield") < first_step
    resumed = next(x for x in seen if x["event"] == "yield" and x["state"] == "resumed")
    assert resumed["step"] == 0 and resumed["paused_s"] >= held_s - 0.5
    assert events.index("done") > first_step
    assert [x["step"] for x in seen if x["event"] == "step"] == [1, 2, 3, 4]
