"""Running the real trainer as a subprocess, for tests and benchmarks.

`write_job(...)` writes data.jsonl and job.json into a directory;
`run_trainer(job_path)` runs `python -m lorafleet_trainer job.json` and
answers its exit status, its stdout lines (raw and parsed) and its stderr;
`run_here(job_path)` answers the same of the trainer's `run` in this
process, sparing the subprocess's imports (seconds a run on two busy cores)
where the process boundary is not what a test is about.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

#: The trainer's command line, less the job file.
TRAINER_ARGV = [sys.executable, "-m", "lorafleet_trainer"]

#: Short, repetitive Q/A pairs (their words are in the tiny tokenizer's text).
QA = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("What is the capital of Italy?", "The capital of Italy is Rome."),
    ("What is the capital of Spain?", "The capital of Spain is Madrid."),
    ("What colour is the sky?", "The sky is blue on a clear day."),
    ("How many legs does a cat have?", "A cat has four legs."),
    ("How many days are in a week?", "There are seven days in a week."),
    ("What do bees make?", "Bees make honey and wax."),
    ("Say hello.", "Hello! How can I help you today?"),
]


def qa_records(repeat: int = 2) -> list[dict[str, Any]]:
    return [{"q": q, "a": a} for q, a in QA] * repeat


def ndjson(records: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def write_job(
    job_dir: Path,
    base_dir: Path,
    *,
    data: str,
    params: dict[str, Any] | None = None,
    data_sha256: str | None = None,
    **overrides: Any,
) -> Path:
    """Write `data` and a CPU job for the base at `base_dir`; answer job.json's path."""
    job_dir.mkdir(parents=True, exist_ok=True)
    data_path = job_dir / "data.jsonl"
    data_path.write_text(data, encoding="utf-8")
    job: dict[str, Any] = {
        "job_id": job_dir.name,
        "base": {"hf_repo": None, "hf_revision": "main", "local_dir": str(base_dir)},
        "data_path": str(data_path),
        "data_sha256": data_sha256 or hashlib.sha256(data.encode()).hexdigest(),
        "out_dir": str(job_dir / "out"),
        "params": params or {},
        "device": "cpu",
        "hf_offline": True,
    }
    job.update(overrides)
    path = job_dir / "job.json"
    path.write_text(json.dumps(job), encoding="utf-8")
    return path


@dataclasses.dataclass
class TrainerRun:
    rc: int
    raw_lines: list[str]
    lines: list[dict[str, Any]]
    stderr: str

    def events(self, event: str) -> list[dict[str, Any]]:
        return [x for x in self.lines if x["event"] == event]

    def states(self) -> list[str]:
        """The states in order, a repeated one once (preparing reports its progress)."""
        out: list[str] = []
        for x in self.events("state"):
            if not out or out[-1] != x["state"]:
                out.append(x["state"])
        return out


def run_trainer(
    job_path: Path, *, timeout_s: float = 150, env: dict[str, str] | None = None
) -> TrainerRun:
    """Run the trainer on `job_path` to its end (HF offline, no progress bars);
    `env` adds to its environment."""
    env = {**_env(), **(env or {})}
    p = subprocess.run(
        [*TRAINER_ARGV, str(job_path)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        cwd=job_path.parent,
        check=False,
    )
    raw = p.stdout.splitlines()
    return TrainerRun(p.returncode, raw, [json.loads(x) for x in raw], p.stderr)


def run_here(job_path: Path) -> TrainerRun:
    """`run_trainer`, in this process (HF offline; stderr is not captured)."""
    import io
    import warnings

    import pytest

    from lorafleet_trainer.jobfile import JobFile
    from lorafleet_trainer.protocol import LineWriter
    from lorafleet_trainer.run import run

    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
        mp.setenv("HF_HUB_OFFLINE", "1")
        warnings.simplefilter("ignore", FutureWarning)  # peft on transformers' renames
        rc = run(JobFile.read(job_path), LineWriter(out))
    raw = out.getvalue().splitlines()
    return TrainerRun(rc, raw, [json.loads(x) for x in raw], "")


def start_trainer(job_path: Path) -> subprocess.Popen[str]:
    """The trainer on `job_path`, its stdout a pipe of JSON lines to read as it
    runs (a test that stops it midway); stderr discarded."""
    return subprocess.Popen(
        [*TRAINER_ARGV, str(job_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=_env(),
    )


def _env() -> dict[str, str]:
    import os

    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
        # Two cores shared with other work: torch's own pool would oversubscribe.
        OMP_NUM_THREADS="1",
    )
    return env


def fake_hf_cache(hf_home: Path, repo: str, model_dir: Path, revision: str = "main") -> Path:
    """Put `model_dir`'s files into a Hugging Face cache under `hf_home`, as
    snapshot_download leaves them, with `revision` pointing at them; answer the
    snapshot directory."""
    import shutil

    commit = hashlib.sha1(repo.encode()).hexdigest()
    repo_dir = hf_home / "hub" / ("models--" + repo.replace("/", "--"))
    snapshot = repo_dir / "snapshots" / commit
    shutil.copytree(model_dir, snapshot)
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs" / revision).write_text(commit)
    return snapshot
