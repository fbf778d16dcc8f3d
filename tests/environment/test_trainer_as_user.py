"""The real trainer, run as root's agent would run it: as the engines' user,
in the stand-in vLLM Python with the overlay, with its caches in its own home."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest

import lorafleet_trainer
from lorafleet_schemas.messages import TrainerError, TrainerLine, TrainerLog
from lorafleet_services.agent.config import AgentConfig
from lorafleet_services.agent.environment.environments import EngineEnvironment, prepare
from lorafleet_services.agent.node.cards import CardChoice
from lorafleet_services.agent.node.process import run_process
from lorafleet_services.local.tiny_model import build_tiny_model
from tests.environment.conftest import make_engines
from tests.trainer.harness import ndjson, qa_records, write_job

CPU = CardChoice(index=None, name="cpu", free_mib=0)


@dataclass
class Run:
    returncode: int
    lines: list[TrainerLine]
    stderr_tail: str

    @property
    def message(self) -> str:
        return " ".join(x.message for x in self.lines if isinstance(x, TrainerError))


async def run_as_user(env: EngineEnvironment, base: Path, job_dir: Path) -> Run:
    """The trainer on `base`, copied into `job_dir` as the agent copies it, run
    there as the environment's user."""
    shutil.rmtree(job_dir, ignore_errors=True)
    job_json = write_job(
        job_dir,
        base,
        data=ndjson(qa_records()),
        params={"max_steps": 2, "batch_size": 4, "max_seq_len": 64, "rank": 4, "alpha": 8},
    )
    package = Path(lorafleet_trainer.__file__).parent
    shutil.copytree(package, job_dir / package.name, ignore=shutil.ignore_patterns("__pycache__"))
    env.give(job_dir)
    lines: list[TrainerLine] = []

    async def keep(raw: bytes) -> None:
        lines.append(msgspec.json.decode(raw, type=TrainerLine))

    res = await run_process(
        [env.python, "-m", "lorafleet_trainer", str(job_json)],
        env=env.process_env(CPU),
        cwd=job_dir,
        user=env.user,
        on_line=keep,
    )
    return Run(res.returncode, lines, res.stderr_tail)


@pytest.mark.slow
async def test_the_real_trainer_runs_as_the_engines_user(
    engine_user: str, user_engine_venv: Path, wheel_dir: Path, open_dir: Path
) -> None:
    engines = make_engines(open_dir / "e-trainer", user_engine_venv)
    work = open_dir / "w-trainer"
    cfg = AgentConfig(
        node="node-1",
        engines_dir=engines.root,
        work_dir=work,
        run_as=engine_user,
        wheel_dir=str(wheel_dir),
    )
    env = await prepare(cfg)
    assert env.user is not None and env.user.uid != 0, env.notes
    base = build_tiny_model("llama", open_dir / "tiny-llama-user")
    job_dir = work / "jobs" / "as-user"
    # transformers saves weights 0600: the trainer says what to change.
    refused = await run_as_user(env, base, job_dir)
    assert refused.returncode == 1
    assert "cannot read model.safetensors" in refused.message
    assert f"chmod -R a+rX {base}" in refused.message
    for f in base.iterdir():
        f.chmod(0o644)
    res = await run_as_user(env, base, job_dir)
    lines = res.lines
    assert res.returncode == 0, res.stderr_tail
    # The trainer's own first line says who it runs as.
    first = lines[0]
    assert isinstance(first, TrainerLog)
    assert first.message.startswith(f"uid={env.user.uid} gid={env.user.gid} ")
    assert lines[-1].__class__.__name__ == "TrainerDone"
    adapter = job_dir / "out" / "adapter" / "adapter_model.safetensors"
    assert adapter.stat().st_uid == env.user.uid
    summary = json.loads((adapter.parent / "training_summary.json").read_text())
    assert summary["device"] == "cpu"
    # Its caches point into its own home under the work directory (that the
    # user can write there is checked from inside a process in
    # test_environment.py).
    penv = env.process_env(CPU)
    for var in ("HOME", "HF_HOME", "XDG_CACHE_HOME", "TRITON_CACHE_DIR"):
        assert Path(penv[var]).is_relative_to(work / "engine-home"), var
    assert env.home.stat().st_uid == env.user.uid
