"""The agent's plain pieces, without a bus: engines found, the stand-in's output."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lorafleet_services.agent.config import AgentConfig, AgentConfigError
from lorafleet_services.agent.environment.environments import find_python
from lorafleet_services.agent.heartbeat import (
    BUCKET_OUTAGE_PATIENCE_S,
    FENCE_MARGIN_S,
    fence_reason,
)
from lorafleet_services.agent.node.card_memory import MemorySampler, session_pids
from lorafleet_services.agent.node.cards import read_cards
from lorafleet_services.agent.node.installed_engines import (
    find_engines,
    newest_vllm_python,
    version_order,
)
from lorafleet_services.agent.node.leftovers import remove_job_dirs
from lorafleet_services.agent.node.process import ProcessResult
from lorafleet_services.agent.training.job_run import trainer_failure
from lorafleet_trainer.standin import adapter_files


def _engine(root: Path, *parts: str) -> None:
    p = root.joinpath(*parts)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("")
    p.chmod(0o755)  # an install is an interpreter that runs


def test_engines_newest_by_version_not_by_text(tmp_path: Path) -> None:
    for v in ("0.9.2", "0.10.1", "0.10.1rc1"):
        _engine(tmp_path, "vllm", v, "bin", "python3")
    (tmp_path / "vllm" / "0.11.0").mkdir()  # no interpreter: not installed
    for tag in ("b987-cpu", "b6100-cuda12", "notes"):
        (tmp_path / "llamacpp" / tag).mkdir(parents=True)
    found = find_engines(tmp_path)
    assert found.vllm == ["0.9.2", "0.10.1rc1", "0.10.1"]
    assert found.llamacpp == "b6100"
    assert newest_vllm_python(tmp_path) == tmp_path / "vllm" / "0.10.1" / "bin" / "python3"
    assert find_engines(tmp_path, "b42").llamacpp == "b42"
    assert find_engines(tmp_path / "missing").vllm == []
    assert version_order("0.10.0") > version_order("0.9.9")


def test_the_heartbeat_and_the_trainer_pick_the_same_vllm(tmp_path: Path) -> None:
    for v in ("0.11.0", "0.11.0+cu128", "0.10.2"):
        _engine(tmp_path, "vllm", v, "bin", "python3")
    (tmp_path / "vllm" / "nightly" / "bin").mkdir(parents=True)  # no interpreter
    reported = find_engines(tmp_path).vllm
    # PEP 440: a local build (+cu128) sorts after its release.
    assert reported == ["0.10.2", "0.11.0", "0.11.0+cu128"]
    trains = find_python(AgentConfig(node="n", engines_dir=tmp_path, work_dir=tmp_path / "w"))
    assert trains == str(tmp_path / "vllm" / reported[-1] / "bin" / "python3")
    assert version_order("0.11.0rc1") < version_order("0.11.0")
    assert version_order("not-a-version") < version_order("0.0.1")


def test_standin_adapter_is_deterministic_per_job() -> None:
    a, b, c = adapter_files("job-a"), adapter_files("job-a"), adapter_files("job-b")
    assert a == b
    assert a["adapter_model.safetensors"] != c["adapter_model.safetensors"]
    assert set(a) == {"adapter_config.json", "adapter_model.safetensors", "probe.json"}


def test_session_pids_sees_the_whole_session() -> None:
    code = (
        "import subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\n"
        "print('up', flush=True)\n"
        "time.sleep(30)"
    )
    p = subprocess.Popen(
        [sys.executable, "-c", code], start_new_session=True, stdout=subprocess.PIPE
    )
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == b"up"
        pids = session_pids(p.pid)
        assert p.pid in pids and len(pids) == 2
        assert os.getpid() not in pids
    finally:
        os.killpg(p.pid, 9)
        p.wait()
        assert p.stdout is not None
        p.stdout.close()


def test_remove_job_dirs(tmp_path: Path) -> None:
    (tmp_path / "jobs" / "old" / "out").mkdir(parents=True)
    assert remove_job_dirs(tmp_path) == ["old"]
    assert list((tmp_path / "jobs").iterdir()) == []
    assert remove_job_dirs(tmp_path / "none") == []


def test_memory_sampler_reads_the_sessions_card_memory_from_nvml() -> None:
    """Only where there is a card: a process in its own session holds 1 GiB on it."""
    if not read_cards():
        pytest.skip("no NVIDIA card here")
    code = (
        "import torch, time\n"
        "x = torch.empty(1 << 30, dtype=torch.uint8, device='cuda')\n"
        "print('up', flush=True)\n"
        "time.sleep(30)"
    )
    p = subprocess.Popen(
        [sys.executable, "-c", code], start_new_session=True, stdout=subprocess.PIPE
    )
    sampler = MemorySampler(p.pid, interval_s=0.2)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == b"up"
        sampler.start()
        for _ in range(50):
            if sampler.peak_mib >= 1024:
                break
            time.sleep(0.1)
        assert sampler.peak_mib >= 1024, sampler.peak_mib
    finally:
        sampler.stop()
        os.killpg(p.pid, 9)
        p.wait()
        assert p.stdout is not None
        p.stdout.close()


def test_fencing_tells_an_unreachable_nats_from_a_bucket_electing() -> None:
    bound_s = 3 - FENCE_MARGIN_S  # before the scheduler can judge the node lost
    assert fence_reason(bound_s - 0.1, bound_s - 0.1, 3) is None
    cut = fence_reason(bound_s + 0.1, bound_s + 0.1, 3)
    assert cut is not None and "NATS unreachable for 2.6 s" in cut
    # The server answers (no responders: the bucket's stream has no leader).
    assert fence_reason(10.0, 0.2, 3) is None
    long = fence_reason(3 + BUCKET_OUTAGE_PATIENCE_S + 1, 0.2, 3)
    assert long is not None and "NATS answers" in long


@pytest.mark.parametrize(
    ("returncode", "stopped", "retryable", "said"),
    [
        (3, False, True, "exit 3: a failure of the node's environment"),
        (-9, False, True, "killed by SIGKILL, which the agent did not send"),
        (143, False, True, "killed by SIGTERM, which the agent did not send"),
        (-15, False, True, "killed by SIGTERM"),
        (1, False, False, "the trainer exited with code 1"),
        (2, False, False, "the trainer exited with code 2"),
        (0, False, False, "without saving an adapter"),
        # Signals the agent sent itself (a cancel, a stop): not the job's cause, but no retry.
        (-9, True, False, "the trainer exited with code -9"),
        (143, True, False, "the trainer exited with code 143"),
    ],
)
def test_which_trainer_failures_are_retryable(
    returncode: int, stopped: bool, retryable: bool, said: str
) -> None:
    result = ProcessResult(returncode=returncode, stderr_tail="last words", stopped=stopped)
    message, got = trainer_failure(result, None)
    assert got is retryable and said in message, message
    assert ("not the job's own failure" in message) is retryable
    # The trainer's own error line is the message, and the exit code still decides.
    message, got = trainer_failure(result, "CUDA error: unspecified launch failure")
    assert got is retryable and "CUDA error: unspecified launch failure" in message


def test_the_trainer_may_be_a_script_of_ones_own(tmp_path: Path) -> None:
    script = tmp_path / "mine.py"
    assert AgentConfig(node="n", trainer=str(script)).runs_standin
    assert not AgentConfig(node="n").runs_standin
    for bad in ("mine.py", "/usr/bin/true", "fast"):
        with pytest.raises(AgentConfigError, match="absolute path of a trainer script"):
            AgentConfig(node="n", trainer=bad)
