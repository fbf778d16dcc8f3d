"""The agent with the real trainer (in this Python, on the CPU) on a tiny Llama
built in the test: the same pipeline as the stand-in's, with real training."""

from __future__ import annotations

import gzip
import io
import os
import sys
import tarfile

import pytest

from lorafleet_schemas.messages import ArtifactKind, JobState, TrainerParams
from lorafleet_services.agent.node.cards import read_cards
from lorafleet_services.local.tiny_model import build_tiny_model
from lorafleet_trainer.probe import PROBE_FILE
from tests.agent.conftest import Bus, start_request
from tests.agent.test_job import delivered


@pytest.mark.slow
async def test_real_trainer_through_the_agent(fleet: Bus) -> None:
    base = build_tiny_model("llama", fleet.tmp_path / "tiny-llama")
    # LORAFLEET_TEST_WHEEL_DIR: where the pinned overlay wheels are, on a
    # machine whose Python has other versions and no index to fetch from.
    agent = await fleet.agent(
        trainer="real",
        python=sys.executable,
        hf_offline=True,
        wheel_dir=os.environ.get("LORAFLEET_TEST_WHEEL_DIR"),
    )
    name, sha = await fleet.upload()
    reports = await fleet.reports("node-1", "job-real")
    req = start_request(
        "job-real",
        name,
        sha,
        params=TrainerParams(max_steps=3, batch_size=4, max_seq_len=64, rank=4, alpha=8),
    )
    req.model.local_dir = str(base)
    assert (await fleet.start(req)).accepted
    last = await reports.until(
        lambda r: r.message.startswith("delivered") or r.state == JobState.FAILED,
        timeout_s=120,
        what="delivered",
    )
    assert last.state != JobState.FAILED, reports.summary()
    assert reports.states() == [JobState.PREPARING, JobState.RUNNING, JobState.UPLOADING]
    steps = [r for r in reports.items if r.loss is not None]
    assert [r.step for r in steps] == [1, 2, 3]
    assert all(r.peak_mib and r.peak_mib > 0 for r in steps)
    tgz = await delivered(fleet, "node-1", "job-real", ArtifactKind.PEFT)
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(tgz))) as tar:
        names = {m.name.rsplit("/", 1)[-1] for m in tar.getmembers() if m.isfile()}
    assert {"adapter_model.safetensors", "adapter_config.json"} <= names
    started = await agent.wait_for_event("trainer.started")
    assert started["python"] == sys.executable
    cards = read_cards()
    assert started["device"] == ("cuda" if cards else "cpu")
    # Trained in fp32 on the CPU: the PEFT probe reference travels in the
    # artifact (on a card the default is bf16, which writes none).
    assert (PROBE_FILE in names) == (not cards), names
