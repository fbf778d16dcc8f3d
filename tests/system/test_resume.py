"""Checkpoints and resume through the whole system (issue 11): a job whose
node is lost with attempts left ends `done` on another node, from its
newest checkpoint; resumed, the real trainer ends where an uninterrupted run
does."""

from __future__ import annotations

import sys
import tarfile

import pytest
import torch
from safetensors.torch import load_file

from lorafleet.artifacts import download_artifact, file_sha256
from lorafleet_schemas.messages import ArtifactKind, JobRecord, JobState
from lorafleet_services.local.tiny_model import build_tiny_model
from tests.eventually import eventually
from tests.system.conftest import Stack, kill_agent

FINISHED = (JobState.DONE, JobState.FAILED, JobState.CANCELLED)
#: The real trainer imports torch and transformers before its first step.
REAL_TIMEOUT_S = 120.0
#: The stand-in's pace: slow enough that a kill lands mid-training.
STEP_S = "0.05"
EVERY_STEPS = 10


async def checkpointed(
    stack: Stack, job_id: str, at_least: int, timeout_s: float = 30.0
) -> JobRecord:
    return await eventually(
        lambda: stack.get(job_id),
        f"a checkpoint of step >= {at_least} stored for {job_id}",
        until=lambda j: j.checkpoint is not None and j.checkpoint.step >= at_least,
        timeout_s=timeout_s,
    )


async def test_a_lost_node_with_attempts_left_resumes_the_job_on_another(stack: Stack) -> None:
    await stack.add_model()
    env = {"LORAFLEET_STANDIN_STEP_S": STEP_S}
    await stack.agent("node-1", env=env)
    await stack.agent("node-2", env=env)
    params = {"max_steps": 80, "checkpoint_every_steps": EVERY_STEPS}
    job = await stack.submit(None, params=params, max_attempts=2)
    seen = await checkpointed(stack, job.id, 2 * EVERY_STEPS)
    first = seen.node
    assert first is not None
    at_kill = (await stack.get(job.id)).step
    kill_agent(stack.agents[first], job.id)

    done = await stack.wait_state(job.id, *FINISHED, timeout_s=60)
    assert done.state is JobState.DONE, done.message
    assert done.node not in (None, first) and done.attempt == 2
    assert done.step == 80
    curve = await stack.curve(job.id)
    steps = [p.step for p in curve.points]
    assert steps == list(range(1, 81)), steps
    resumed = min(p.step for p in curve.points if p.attempt == 2) - 1
    # The work lost is at most one checkpoint interval (and the delivery's lag).
    assert resumed % EVERY_STEPS == 0 and at_kill - resumed <= 2 * EVERY_STEPS, (at_kill, resumed)
    assert all(p.attempt == 1 for p in curve.points if p.step <= resumed)
    moves = [(e.from_state, e.to_state) for e in curve.events]
    assert any(to is JobState.QUEUED and fr is not None for fr, to in moves), moves
    listed = await stack.call(stack.settings.names.artifacts_list, {"job_id": job.id})
    peft = next(a for a in listed["artifacts"] if a["kind"] == "peft")
    out = stack.tmp_path / "peft.tar.gz"
    await download_artifact(stack.js, stack.settings.names, job.id, ArtifactKind.PEFT, out)
    assert file_sha256(out) == peft["sha256"]
    print(f"killed at step {at_kill}, resumed from {resumed} on {done.node}")


async def adapter_tensors(stack: Stack, job_id: str) -> dict[str, torch.Tensor]:
    out = stack.tmp_path / f"{job_id}.tar.gz"
    await download_artifact(stack.js, stack.settings.names, job_id, ArtifactKind.PEFT, out)
    into = stack.tmp_path / job_id
    with tarfile.open(out) as tar:
        tar.extractall(into, filter="data")
    (weights,) = into.rglob("adapter_model.safetensors")
    return load_file(weights)


@pytest.mark.slow
async def test_the_real_trainer_resumed_on_another_node_ends_as_an_uninterrupted_run(
    stack: Stack,
) -> None:
    """SIGKILL of the node at step k, resume on another from the checkpoint at
    c <= k: the same adapter (max abs difference <= 1e-6), the same losses and
    eval losses (on the job's own evaluation set) from c + 1 on, and the same
    trained tokens over both attempts as the same job run without a break."""
    base = build_tiny_model("llama", stack.tmp_path / "models" / "tiny-llama")
    await stack.call(
        stack.settings.names.models_add,
        {"name": "tiny-llama", "engine": "vllm", "local_dir": str(base)},
    )
    real = {"trainer": "real", "python": sys.executable, "hf_offline": True}
    await stack.agent("node-1", **real)
    await stack.agent("node-2", **real)
    params = {
        "max_steps": 30, "batch_size": 2, "max_seq_len": 64, "rank": 4, "alpha": 8,
        "checkpoint_every_steps": 4, "eval_fraction": 0.0,
    }  # fmt: skip
    held = "".join(f'{{"q": "what is {i} times {i}?", "a": "{i * i}"}}\n' for i in range(3))
    whole = await stack.submit("node-2", model="tiny-llama", params=params, eval_data=held)
    whole_done = await stack.wait_state(whole.id, *FINISHED, timeout_s=REAL_TIMEOUT_S)
    assert whole_done.state is JobState.DONE, whole_done.message

    cut = await stack.submit(
        "node-1", model="tiny-llama", params=params, max_attempts=2, eval_data=held
    )
    seen = await checkpointed(stack, cut.id, 8, timeout_s=REAL_TIMEOUT_S)
    kill_agent(stack.agents["node-1"], cut.id)
    assert seen.checkpoint is not None
    # Named for node-1, the job waits for it: the node comes back (a new agent).
    await stack.agent("node-1", **real)
    done = await stack.wait_state(cut.id, *FINISHED, timeout_s=REAL_TIMEOUT_S)
    assert done.state is JobState.DONE and done.attempt == 2, done.message

    curve, whole_curve = await stack.curve(cut.id), await stack.curve(whole.id)
    resumed = min(p.step for p in curve.points if p.attempt == 2) - 1
    assert resumed >= seen.checkpoint.step and resumed % 4 == 0
    after = {p.step: p.loss for p in curve.points if p.step > resumed}
    expected = {p.step: p.loss for p in whole_curve.points if p.step > resumed}
    assert after == expected, (after, expected)
    evals = {e.step: e.eval_loss for e in curve.evals if e.step > resumed}
    assert evals and evals == {e.step: e.eval_loss for e in whole_curve.evals if e.step > resumed}
    assert done.eval_records == 3 and done.eval_dataset == whole_done.eval_dataset
    # trained_tokens: the steps before the checkpoint count, from its progress.
    assert done.tokens_seen is not None and done.tokens_seen == whole_done.tokens_seen
    mine, theirs = await adapter_tensors(stack, cut.id), await adapter_tensors(stack, whole.id)
    assert mine.keys() == theirs.keys() and mine
    worst = max(float((mine[k] - theirs[k]).abs().max()) for k in mine)
    assert worst <= 1e-6, worst
    print(f"resumed from step {resumed}; max abs difference of the adapters {worst:g}")
