"""The trainer as the agent ships it: the package copied into a job
directory, run from there with `python -m` (agent/training/job_run.py trainer_argv)."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import lorafleet_trainer
from lorafleet_services.agent.training.job_run import trainer_argv


def _ship(job_dir: Path) -> Path:
    """The package copied into `job_dir` as the agent copies it."""
    package = Path(lorafleet_trainer.__file__).parent
    copy = job_dir / package.name
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def test_a_module_of_the_copied_package_runs_with_dash_m(tmp_path: Path) -> None:
    copy = _ship(tmp_path)
    job = tmp_path / "job.json"
    after_prelude = slice(-3, None)
    assert trainer_argv("py", copy / "__main__.py", job)[after_prelude] == [
        "-m",
        "lorafleet_trainer",
        str(job),
    ]
    assert trainer_argv("py", copy / "standin.py", job)[after_prelude] == [
        "-m",
        "lorafleet_trainer.standin",
        str(job),
    ]
    own = tmp_path / "trainer.py"
    assert trainer_argv("py", own, job)[-2:] == [str(own), str(job)]


def test_the_copy_runs_from_the_job_directory(tmp_path: Path) -> None:
    """The stand-in from the copy (not the installed package): it imports what
    lies beside job.json, and the copy holds no bytecode of the source's."""
    copy = _ship(tmp_path)
    assert not list(copy.rglob("__pycache__"))
    data = '{"q": "a", "a": "b"}\n'
    (tmp_path / "data.jsonl").write_text(data)
    job = {
        "job_id": "shipped",
        "base": {"hf_repo": None, "local_dir": str(tmp_path / "base")},
        "data_path": str(tmp_path / "data.jsonl"),
        "data_sha256": hashlib.sha256(data.encode()).hexdigest(),
        "out_dir": str(tmp_path / "out"),
        "params": {"max_steps": 2},
        "device": "cpu",
    }
    (tmp_path / "job.json").write_text(json.dumps(job))
    where = "import lorafleet_trainer.standin as s, sys; print(s.__file__)"
    p = subprocess.run(
        [sys.executable, "-c", where], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert Path(p.stdout.strip()) == copy / "standin.py"
    argv = trainer_argv(sys.executable, copy / "standin.py", tmp_path / "job.json")
    run = subprocess.run(
        argv,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
        env={"LORAFLEET_STANDIN_STEP_S": "0", "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert run.returncode == 0, run.stderr
    events = [json.loads(x)["event"] for x in run.stdout.splitlines() if x.startswith("{")]
    assert events[-1] == "done"
