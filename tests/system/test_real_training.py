"""The real trainer through the whole system: submit over NATS -> scheduler ->
agent -> real LoRA training of a tiny Llama on the CPU -> loss curve, peak
memory and the adapter in the recorder and the artifact-store."""

from __future__ import annotations

import sys

import pytest

from lorafleet_schemas.messages import JobState
from lorafleet_services.local.tiny_model import build_tiny_model
from tests.eventually import eventually
from tests.system.conftest import Stack, pid_alive, start_requests, trainer_pids

#: The real trainer imports torch and transformers before its first step.
REAL_TIMEOUT_S = 120.0


async def real_stack(stack: Stack) -> None:
    base = build_tiny_model("llama", stack.tmp_path / "models" / "tiny-llama")
    await stack.call(
        stack.settings.names.models_add,
        {"name": "tiny-llama", "engine": "vllm", "local_dir": str(base)},
    )
    await stack.agent("node-1", trainer="real", python=sys.executable, hf_offline=True)


@pytest.mark.slow
async def test_submit_to_trained_adapter_through_the_system(stack: Stack) -> None:
    await real_stack(stack)
    params = {"max_steps": 4, "batch_size": 4, "max_seq_len": 64, "rank": 4, "alpha": 8}
    job = await stack.submit("node-1", model="tiny-llama", params=params)
    done = await stack.wait_state(
        job.id, JobState.DONE, JobState.FAILED, JobState.CANCELLED, timeout_s=REAL_TIMEOUT_S
    )
    assert done.state is JobState.DONE, done.message
    assert done.step == 4 and done.steps == 4
    assert done.loss is not None and done.peak_mib > 0
    curve = await stack.curve(job.id)
    assert [p.step for p in curve.points] == [1, 2, 3, 4]
    assert all(p.peak_mib and p.peak_mib > 0 for p in curve.points)
    assert all(p.learning_rate is not None and p.tokens_per_s for p in curve.points)
    arts = await stack.call(stack.settings.names.artifacts_list, {"job_id": job.id})
    assert [a["kind"] for a in arts["artifacts"]] == ["peft"]
    assert start_requests(stack.agents["node-1"]) == [job.id]


@pytest.mark.slow
async def test_cancel_mid_training_leaves_no_trainer(stack: Stack) -> None:
    await real_stack(stack)
    params = {"max_steps": 100_000, "batch_size": 2, "max_seq_len": 64, "rank": 4, "alpha": 8}
    job = await stack.submit("node-1", model="tiny-llama", params=params)

    async def training() -> bool:
        return (await stack.get(job.id)).step >= 2

    await eventually(training, "two optimizer steps", timeout_s=REAL_TIMEOUT_S)
    pids = trainer_pids(stack.agents["node-1"], job.id)
    assert pids and all(pid_alive(p) for p in pids)
    stopped = await stack.cancel(job.id, reason="enough")
    assert stopped.state is JobState.CANCELLED

    async def gone() -> bool:
        return not any(pid_alive(p) for p in pids)

    await eventually(gone, f"trainer processes {pids} to end", timeout_s=15)
    assert (await stack.get(job.id)).state is JobState.CANCELLED


@pytest.mark.slow
async def test_a_llamacpp_model_ends_done_with_peft_and_gguf(stack: Stack) -> None:
    from gguf import GGUFReader

    from lorafleet.artifacts import download_artifact
    from lorafleet_schemas.messages import ArtifactKind
    from tests.conversion import llamacpp_source

    tarball = llamacpp_source.release_tarball()  # cached; the agent's fetch reads it
    base = build_tiny_model("llama", stack.tmp_path / "models" / "tiny-gguf")
    await stack.call(
        stack.settings.names.models_add,
        {"name": "tiny-gguf", "engine": "llamacpp", "local_dir": str(base)},
    )
    await stack.agent(
        "node-1",
        trainer="real",
        python=sys.executable,
        hf_offline=True,
        conversion_source=str(tarball.parent / "{tag}.tar.gz"),
        llamacpp_tag=llamacpp_source.TAG,
    )
    params = {"max_steps": 2, "batch_size": 4, "max_seq_len": 64, "rank": 4, "alpha": 8}
    job = await stack.submit("node-1", model="tiny-gguf", params=params)
    done = await stack.wait_state(
        job.id, JobState.DONE, JobState.FAILED, JobState.CANCELLED, timeout_s=REAL_TIMEOUT_S
    )
    assert done.state is JobState.DONE, done.message
    assert sorted(done.artifacts_stored) == [ArtifactKind.GGUF, ArtifactKind.PEFT]
    path = [e.to_state for e in (await stack.curve(job.id)).events]
    assert JobState.CONVERTING in path and path[-2:] == [JobState.UPLOADING, JobState.DONE]
    out = stack.tmp_path / "downloads"
    out.mkdir()
    gguf_rec = await download_artifact(
        stack.js, stack.settings.names, job.id, ArtifactKind.GGUF, out / "a.gguf"
    )
    peft_rec = await download_artifact(
        stack.js, stack.settings.names, job.id, ArtifactKind.PEFT, out / "a.tar.gz"
    )
    assert gguf_rec.node == peft_rec.node == "node-1"
    reader = GGUFReader(out / "a.gguf")
    field = reader.fields["general.type"]
    assert bytes(field.parts[field.data[0]]).decode() == "adapter"
    assert any(t.name.endswith(".lora_a") for t in reader.tensors)
