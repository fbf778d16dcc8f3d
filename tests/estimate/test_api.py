"""`jobs.estimate` and the submit's memory check: as plain functions, then through
a real recorder (nats-server, PostgreSQL) with the project's client."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest

from lorafleet.client import Client
from lorafleet.errors import BadRequestError
from lorafleet.estimate import estimate_memory
from lorafleet.nats import _bus as bus
from lorafleet.settings import Settings
from lorafleet_schemas.messages import (
    Engine,
    JobEstimateRequest,
    JobSpec,
    ModelArchitecture,
    ModelRecord,
    ModelSpec,
    TrainerParams,
)
from lorafleet_services.cli.estimate import estimate_text
from lorafleet_services.local.tiny_model import build_tiny_model
from lorafleet_services.recorder import db
from lorafleet_services.recorder.api import job_estimate, memory_checked
from lorafleet_services.recorder.service import Recorder

ARCH = ModelArchitecture(
    num_hidden_layers=32,
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
)
PARAMS = TrainerParams(batch_size=8, max_seq_len=2048)
QA = '{"q": "2+2?", "a": "4"}\n{"q": "capital of France?", "a": "Paris"}\n'


def _model(arch: ModelArchitecture | None) -> ModelRecord:
    return ModelRecord(
        name="m8b",
        engine=Engine.VLLM,
        hf_repo="org/m8b",
        hf_revision="main",
        local_dir=None,
        description="",
        created_at=dt.datetime.now(dt.UTC),
        architecture=arch,
    )


def test_a_submit_below_the_estimate_is_refused_with_both_numbers_and_what_to_change() -> None:
    fixed = msgspec.structs.replace(PARAMS, gradient_checkpointing=False)
    # Without checkpointing the least is forward passes of one row at a time.
    total = estimate_memory(ARCH, fixed, budget_mib=1).total_mib
    assert total < estimate_memory(ARCH, fixed).total_mib
    spec = JobSpec(model="m8b", gpu_memory_mib=total - 1, data=QA, params=fixed)
    with pytest.raises(BadRequestError) as e:
        memory_checked(_model(ARCH), spec)
    message = str(e.value)
    assert f"gpu_memory_mib {total - 1} is below the memory estimate of {total} MiB" in message
    for change in ("batch_size", "max_seq_len", "gradient_checkpointing", "ignore_estimate"):
        assert change in message
    assert e.value.field == "$.gpu_memory_mib"
    assert memory_checked(_model(ARCH), msgspec.structs.replace(spec, gpu_memory_mib=total))
    forced = msgspec.structs.replace(spec, ignore_estimate=True)
    assert memory_checked(_model(ARCH), forced).gpu_memory_mib == total - 1
    # With "auto" the same budget takes gradient checkpointing instead.
    auto = msgspec.structs.replace(spec, params=PARAMS)
    assert PARAMS.gradient_checkpointing == "auto"
    assert memory_checked(_model(ARCH), auto).gpu_memory_mib == total - 1
    checkpointed = estimate_memory(ARCH, PARAMS, budget_mib=total - 1)
    assert checkpointed.total_mib <= total - 1
    assert "gradient checkpointing every" in checkpointed.lines[4].note


def test_a_submit_without_memory_asks_for_the_estimate_and_its_margin() -> None:
    spec = JobSpec(model="m8b", data=QA, params=PARAMS)
    est = estimate_memory(ARCH, PARAMS)
    assert memory_checked(_model(ARCH), spec).gpu_memory_mib == est.recommended_mib
    assert est.recommended_mib > est.total_mib
    with pytest.raises(BadRequestError, match="give gpu_memory_mib: model m8b was added without"):
        memory_checked(_model(None), spec)
    # Without an architecture a given amount is taken as it is.
    given = msgspec.structs.replace(spec, gpu_memory_mib=1)
    assert memory_checked(_model(None), given).gpu_memory_mib == 1


def test_the_estimate_answer_and_its_text() -> None:
    req = JobEstimateRequest(model="m8b", params=PARAMS, gpu_memory_mib=1000)
    answer = job_estimate(_model(ARCH), req)
    assert answer.estimate is not None and not answer.fits
    text = estimate_text(answer, 1000)
    for name in ("weights", "adapter", "gradients", "optimizer states", "activations"):
        assert f"  {name}" in text
    assert "CUDA context" in text and "refused: gpu_memory_mib 1000 is below" in text
    none = job_estimate(_model(None), req)
    assert none.estimate is None and none.fits
    assert estimate_text(none).startswith("no memory estimate for model m8b: model m8b was added")


@dataclass
class Running:
    client: Client
    settings: Settings


@pytest.fixture
async def running(settings: Settings, pg_url: str) -> AsyncIterator[Running]:
    s = settings.with_(database_url=pg_url)
    rnc = await bus.connect(s, "recorder-under-test")
    await bus.ensure_layout(rnc.jetstream(), bus.layout_for(s))
    recorder = Recorder(s, rnc, db.create_engine(pg_url))
    await recorder.start()
    try:
        async with await Client.connect(s) as c:
            yield Running(c, s)
    finally:
        await recorder.stop()
        await bus.drain_quietly(rnc)


async def test_estimate_and_submit_through_the_recorder(running: Running, tmp_path: Path) -> None:
    client = running.client
    base = build_tiny_model("llama", tmp_path / "tiny")
    added = await client.add_model(ModelSpec(name="tiny", engine=Engine.VLLM, local_dir=str(base)))
    assert added.architecture is not None and added.architecture.hidden_size == 64
    (listed,) = await client.models()
    assert listed.architecture == added.architecture  # kept by the catalog

    answer = await client.estimate(JobEstimateRequest(model="tiny", gpu_memory_mib=10))
    assert answer.estimate is not None and not answer.fits
    # Within 10 MiB "auto" checkpoints every layer, and that does not fit either.
    total = answer.estimate.total_mib
    unbudgeted = await client.estimate(JobEstimateRequest(model="tiny"))
    assert unbudgeted.estimate is not None and unbudgeted.fits
    assert unbudgeted.estimate.total_mib > total
    job = await client.submit(JobSpec(model="tiny", data=QA))
    assert job.gpu_memory_mib == unbudgeted.estimate.recommended_mib
    with pytest.raises(BadRequestError, match=f"below the memory estimate of {total} MiB"):
        await client.submit(JobSpec(model="tiny", data=QA, gpu_memory_mib=10))
    forced = await client.submit(
        JobSpec(model="tiny", data=QA, gpu_memory_mib=10, ignore_estimate=True)
    )
    assert forced.gpu_memory_mib == 10

    bare = await client.add_model(
        ModelSpec(name="bare", engine=Engine.VLLM, local_dir=str(tmp_path / "none"))
    )
    assert bare.architecture is None
    none = await client.estimate(JobEstimateRequest(model="bare"))
    assert none.estimate is None and "added without its architecture" in none.reason
    with pytest.raises(BadRequestError, match="give gpu_memory_mib"):
        await client.submit(JobSpec(model="bare", data=QA))


def test_the_agent_refines_the_estimate_with_the_real_lengths() -> None:
    from lorafleet_schemas.messages import StartRequest, TrainerLengths
    from lorafleet_services.agent.training.trainer_lines import job_estimate_mib, lengths_note

    # Checkpointing fixed: with "auto" shorter rows may take less of it instead.
    every_layer = msgspec.structs.replace(PARAMS, gradient_checkpointing=True)
    req = StartRequest(
        job_id="j1",
        attempt=1,
        model=_model(ARCH),
        gpu_memory_mib=60000,
        dataset="d",
        dataset_sha256="0" * 64,
        params=every_layer,
        artifacts=[],
    )
    line = TrainerLengths(
        records_tokenized=900, records_cut=3, records_skipped=0,
        min=20, p50=180, p95=700, max=1200, mean=240,
    )  # fmt: skip
    refined = estimate_memory(ARCH, every_layer, seq_len=1200, budget_mib=60000).total_mib
    was = job_estimate_mib(req)
    assert was == estimate_memory(ARCH, every_layer, budget_mib=60000).total_mib and refined < was
    # With "auto" the note says what the trainer will do: shorter rows, less checkpointing.
    auto = msgspec.structs.replace(req, params=PARAMS)
    assert job_estimate_mib(auto) == estimate_memory(ARCH, PARAMS, budget_mib=60000).total_mib
    assert job_estimate_mib(auto) < estimate_memory(ARCH, PARAMS, seq_len=1200).total_mib
    assert lengths_note(line, req) == (
        "tokenized 900 records: 180 tokens at the median, 700 at p95, 1200 the longest; "
        f"3 cut at max_seq_len 2048; memory estimate for rows of 1200 tokens {refined} MiB "
        f"(was {was} MiB for 2048; the job has 60000 MiB)"
    )
    bare = msgspec.structs.replace(req, model=_model(None))
    assert lengths_note(line, bare).endswith("3 cut at max_seq_len 2048")
    assert job_estimate_mib(bare) is None


async def lorafleet(settings: Settings, *args: str) -> tuple[int, str, str]:
    """`lorafleet ARGS` run as a user types it, against the test's recorder."""
    env = {**os.environ, **settings.to_env(), "COLUMNS": "200"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "lorafleet_services.cli", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_the_command_line_estimates_and_dry_runs(running: Running, tmp_path: Path) -> None:
    base = build_tiny_model("llama", tmp_path / "tiny")
    rc, out, err = await lorafleet(
        running.settings, "models", "add", "tiny", "--engine", "vllm", "--local-dir", str(base),
        "--json",
    )  # fmt: skip
    assert rc == 0, err
    assert json.loads(out)["architecture"]["num_hidden_layers"] == 2
    rc, out, err = await lorafleet(
        running.settings, "models", "add", "bare", "--engine", "vllm", "--local-dir", "/nowhere"
    )
    assert rc == 0 and "no architecture, so no memory estimates for its jobs" in err

    rc, out, err = await lorafleet(
        running.settings, "estimate", "--model", "tiny", "--param", "batch_size=2"
    )
    assert rc == 0, err
    assert out.startswith("memory estimate for model tiny (bf16, rows of 1024 tokens):")
    assert (
        "  activations" in out and "2 rows of 1024 tokens" in out and "with the 10% margin" in out
    )
    data = tmp_path / "pairs.jsonl"
    data.write_text(QA)
    dry = ("submit", "--model", "tiny", "--data", str(data), "--dry-run", "--gpu-memory-mib", "10")
    rc, out, err = await lorafleet(running.settings, *dry)
    assert rc == 1 and "refused: gpu_memory_mib 10 is below the memory estimate" in out
    rc, out, err = await lorafleet(running.settings, "estimate", "--model", "bare", "--json")
    assert rc == 0 and json.loads(out)["estimate"] is None
    assert await running.client.jobs() == []  # nothing was queued
