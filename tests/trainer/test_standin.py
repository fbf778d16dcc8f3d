"""The stand-in trainer's checkpoints and resume: the real trainer's protocol,
cheaply (the agent's and system tests lean on it)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec

from lorafleet_schemas.messages import TrainerLine
from tests.trainer.harness import TrainerRun


def _job(job_dir: Path, **overrides: Any) -> Path:
    job_dir.mkdir(parents=True, exist_ok=True)
    data = '{"q": "a", "a": "b"}\n'
    (job_dir / "data.jsonl").write_text(data)
    job = {
        "job_id": job_dir.name,
        "base": {"hf_repo": None, "hf_revision": "main", "local_dir": str(job_dir / "base")},
        "data_path": str(job_dir / "data.jsonl"),
        "data_sha256": hashlib.sha256(data.encode()).hexdigest(),
        "out_dir": str(job_dir / "out"),
        "params": {"max_steps": 6, "checkpoint_every_steps": 2},
        "device": "cpu",
        "checkpoint_dir": str(job_dir / "checkpoints"),
        **overrides,
    }
    (job_dir / "job.json").write_text(json.dumps(job))
    return job_dir / "job.json"


def _run(job: Path, **env: str) -> TrainerRun:
    p = subprocess.run(
        [sys.executable, "-m", "lorafleet_trainer.standin", str(job)],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "LORAFLEET_STANDIN_STEP_S": "0", **env},
        check=False,
    )
    lines = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    for x in lines:  # the schemas' lines, strictly
        assert msgspec.to_builtins(msgspec.convert(x, TrainerLine)) == x  # type: ignore[arg-type]
    return TrainerRun(p.returncode, p.stdout.splitlines(), lines, p.stderr)


def test_the_standin_checkpoints_and_continues_after_the_checkpoints_step(tmp_path: Path) -> None:
    first = _run(_job(tmp_path / "a"))
    assert first.rc == 0, first.stderr
    ckpts = first.events("checkpoint")
    # Every 2 steps of 6, not after the last.
    assert [x["step"] for x in ckpts] == [2, 4]
    assert sorted(os.listdir(tmp_path / "a" / "checkpoints")) == ["step-00000002", "step-00000004"]
    meta = json.loads((Path(ckpts[1]["path"]) / "checkpoint.json").read_text())
    assert meta["format"] == 1 and meta["step"] == 4

    resumed = _run(
        _job(
            tmp_path / "b",
            resume={"dir": ckpts[1]["path"], "mode": "continue"},
            checkpoint_dir=None,
        )
    )
    assert resumed.rc == 0, resumed.stderr
    steps = resumed.events("step")
    assert [s["step"] for s in steps] == [5, 6]
    assert [s["loss"] for s in steps] == [s["loss"] for s in first.events("step")][4:]
    # The tokens of the steps before the checkpoint count too (its progress holds them).
    tokens = [r.events("done")[0]["summary"]["tokens_seen"] for r in (first, resumed)]
    assert tokens == [600, 600]

    # A directory of checkpoints: its newest; "weights" starts from step 1.
    newest = _run(
        _job(
            tmp_path / "c", resume={"dir": str(tmp_path / "a" / "checkpoints"), "mode": "continue"}
        )
    )
    assert newest.events("step")[0]["step"] == 5
    weights = _run(_job(tmp_path / "d", resume={"dir": ckpts[0]["path"], "mode": "weights"}))
    assert weights.events("step")[0]["step"] == 1
    assert weights.events("done")[0]["summary"]["tokens_seen"] == 600


def test_the_standin_refuses_an_incomplete_checkpoint(tmp_path: Path) -> None:
    half = tmp_path / "ckpt" / ".tmp-step-00000002"
    half.mkdir(parents=True)
    for d in (half, tmp_path / "empty"):
        d.mkdir(exist_ok=True)
        run = _run(_job(tmp_path / f"j{d.name}", resume={"dir": str(d), "mode": "continue"}))
        assert run.rc == 2
        assert run.lines[-1]["event"] == "error" and str(d) in run.lines[-1]["message"]


def test_the_standin_fails_as_the_node_when_asked(tmp_path: Path) -> None:
    run = _run(_job(tmp_path / "j"), LORAFLEET_STANDIN_FAIL_AT="3", LORAFLEET_STANDIN_FAIL_EXIT="3")
    assert run.rc == 3
    assert [x["step"] for x in run.events("checkpoint")] == [2]
