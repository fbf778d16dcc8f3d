"""The official openai SDK against the stand-in engine, for what the real
vLLM cannot do cheaply: pagination over 25 jobs, cancel, pause and resume,
a stream relayed as the engine sends it, a validation file evaluated on.
The happy path, upload to chat with the fine-tuned model, runs on the real
vLLM: tests/gateway/sdk_real.py, run by tests/system/test_real_serving.py."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from pathlib import Path
from typing import Any, cast

import openai
import pytest
from openai import AsyncOpenAI
from openai.types.fine_tuning import FineTuningJob

from lorafleet.names import dataset_object_name
from lorafleet_trainer.standin import TOKENS_PER_STEP
from tests.gateway.conftest import Gateway
from tests.gateway.engine import SLOW_GAP_S

pytestmark = pytest.mark.asyncio(loop_scope="module")

DATA = "".join(
    json.dumps({"messages": [{"role": "user", "content": f"what is {i}+{i}?"},
                             {"role": "assistant", "content": str(2 * i)}]}) + "\n"
    for i in range(20)
).encode()  # fmt: skip
#: A validation file of 3 records (the stand-in's eval loss tells it by its size).
HELD = "".join(
    json.dumps({"messages": [{"role": "user", "content": f"what is {i}*{i}?"},
                             {"role": "assistant", "content": str(i * i)}]}) + "\n"
    for i in range(3)
).encode()  # fmt: skip
#: Seconds a stand-in job has to succeed.
JOB_TIMEOUT_S = 60.0


async def wait_status(sdk: AsyncOpenAI, job_id: str, *statuses: str) -> FineTuningJob:
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while True:
        job = await sdk.fine_tuning.jobs.retrieve(job_id)
        if job.status in statuses:
            return job
        assert time.monotonic() < deadline, f"job {job_id} is {job.status}: {job}"
        await asyncio.sleep(0.2)


async def test_pagination_over_25_jobs(gateway: Gateway) -> None:
    async with gateway.sdk("bob") as sdk, gateway.sdk("alice") as alice:
        await paginate_and_cancel(sdk, alice)


async def paginate_and_cancel(sdk: AsyncOpenAI, alice: AsyncOpenAI) -> None:
    uploaded = await sdk.files.create(file=("pairs.jsonl", DATA), purpose="fine-tune")
    made = []
    for n in range(25):
        job = await sdk.fine_tuning.jobs.create(
            model="tiny", training_file=uploaded.id, suffix=f"n{n}",
            extra_body={"lorafleet": {"node": "node-2", "gpu_memory_mib": 1000}},
        )  # fmt: skip
        made.append(job.id)
    first = await sdk.fine_tuning.jobs.list(limit=10)
    assert [j.id for j in first.data] == made[::-1][:10] and first.has_more
    every = [j.id async for j in sdk.fine_tuning.jobs.list(limit=10)]
    assert every == made[::-1]
    # Another key sees none of them.
    assert not {j.id async for j in alice.fine_tuning.jobs.list()} & set(every)

    cancelled = await sdk.fine_tuning.jobs.cancel(made[0])
    assert cancelled.status == "cancelled"
    assert (await sdk.fine_tuning.jobs.retrieve(made[0])).status == "cancelled"
    for job_id in made[1:]:
        await sdk.fine_tuning.jobs.cancel(job_id)


async def test_a_stream_is_relayed_as_the_engine_sends_it(gateway: Gateway) -> None:
    """The engine waits SLOW_GAP_S between chunks: the first must arrive long
    before the last (a relay that buffered would deliver them together)."""
    async with gateway.sdk() as sdk:
        started = time.monotonic()
        stream = await sdk.completions.create(model="tiny", prompt="answer me slowly", stream=True)
        arrivals = [time.monotonic() - started async for _ in stream]
    assert len(arrivals) >= 3
    assert arrivals[-1] - arrivals[0] >= 2 * SLOW_GAP_S


async def test_pause_keeps_the_checkpoint_and_resume_finishes_from_it(gateway: Gateway) -> None:
    trainer = Path(__file__).resolve().parents[1] / "agent" / "checkpointing_trainer.py"
    knobs = {"LORAFLEET_STANDIN_TEST_STEPS": "60", "LORAFLEET_STANDIN_TEST_STEP_S": "0.1",
             "LORAFLEET_STANDIN_TEST_EVERY": "2"}  # fmt: skip
    await gateway.stack.agent("node-ckpt", env=knobs, trainer=str(trainer))
    async with gateway.sdk() as sdk:
        uploaded = await sdk.files.create(file=("pairs.jsonl", DATA), purpose="fine-tune")
        job = await sdk.fine_tuning.jobs.create(
            model="tiny", training_file=uploaded.id,
            extra_body={"lorafleet": {"node": "node-ckpt", "gpu_memory_mib": 1000,
                                      "checkpoint_every_steps": 2}},
        )  # fmt: skip
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while not [c async for c in sdk.fine_tuning.jobs.checkpoints.list(job.id)]:
            assert time.monotonic() < deadline, "no checkpoint was stored"
            await asyncio.sleep(0.2)
        paused = await sdk.fine_tuning.jobs.pause(job.id)
        assert paused.status == "paused"
        assert (await wait_status(sdk, job.id, "paused")).lorafleet["state"] == "cancelled"  # type: ignore[attr-defined]
        resumed = await sdk.fine_tuning.jobs.resume(job.id)
        assert resumed.status in ("queued", "running")
        done = await wait_status(sdk, job.id, "succeeded", "failed")
        assert done.status == "succeeded", done
        assert done.lorafleet["attempt"] == 2  # type: ignore[attr-defined]


async def test_a_validation_file_is_the_jobs_evaluation_set(gateway: Gateway) -> None:
    """validation_file -> the job's eval_dataset -> the agent fetches it -> the
    trainer evaluates on it -> valid_loss in the metrics events. The
    stand-in's eval loss is its train loss plus a thousandth per record of
    the set it evaluated: 3 here, none had it held out of the training file."""
    async with gateway.sdk() as sdk:
        train = await sdk.files.create(file=("pairs.jsonl", DATA), purpose="fine-tune")
        valid = await sdk.files.create(file=("held.jsonl", HELD), purpose="fine-tune")
        job = await sdk.fine_tuning.jobs.create(
            model="tiny", training_file=train.id, validation_file=valid.id,
            extra_body={"lorafleet": {"node": "node-1", "gpu_memory_mib": 1000}},
        )  # fmt: skip
        assert job.validation_file == valid.id
        done = await wait_status(sdk, job.id, "succeeded", "failed")
        assert done.status == "succeeded", done
        assert (done.training_file, done.validation_file) == (train.id, valid.id)
        events = [e async for e in sdk.fine_tuning.jobs.list_events(job.id, limit=100)]
        listed = [j async for j in sdk.fine_tuning.jobs.list()]
    record = await gateway.stack.get(done.id.removeprefix("ftjob-"))
    assert record.eval_dataset == dataset_object_name(hashlib.sha256(HELD).hexdigest())
    assert record.eval_records == 3 and record.records == 20
    metrics = [e.data for e in events if e.type == "metrics"]
    assert metrics and all(m is not None for m in metrics)
    valid_losses = [(m["train_loss"], m["valid_loss"]) for m in metrics if m and "valid_loss" in m]
    assert valid_losses, metrics
    assert all(v == pytest.approx(t + 0.003, abs=1e-6) for t, v in valid_losses), valid_losses
    # Every step the stand-in trained counts; it counts TOKENS_PER_STEP a step.
    assert done.trained_tokens == record.steps * TOKENS_PER_STEP and record.steps > 0
    assert [j.validation_file for j in listed if j.id == job.id] == [valid.id]


#: Preference pairs in OpenAI's format (the second file: one record is bad).
PAIRS = "".join(
    json.dumps({"input": {"messages": [{"role": "user", "content": f"what is {i}+{i}?"}]},
                "preferred_output": [{"role": "assistant", "content": str(2 * i)}],
                "non_preferred_output": [{"role": "assistant", "content": str(2 * i + 1)}]})
    + "\n"
    for i in range(12)
).encode()  # fmt: skip
BAD_PAIRS = PAIRS.split(b"\n")[0] + b'\n{"prompt": "1+1?", "chosen": "2"}\n'


async def test_a_dpo_job_on_a_supervised_jobs_model(gateway: Gateway) -> None:
    """Preference tuning on top of a supervised adapter, through the SDK: the
    fine-tuned model's name maps to a start from its job's adapter, on the
    same catalog base; the job echoes its method and names its parent."""
    async with gateway.sdk() as sdk, gateway.sdk("bob") as bob:
        sft_file = await sdk.files.create(file=("sft.jsonl", DATA), purpose="fine-tune")
        sft = await sdk.fine_tuning.jobs.create(
            model="tiny", training_file=sft_file.id,
            extra_body={"lorafleet": {"node": "node-1", "gpu_memory_mib": 1000}},
        )  # fmt: skip
        parent = await wait_status(sdk, sft.id, "succeeded", "failed")
        assert parent.status == "succeeded" and parent.fine_tuned_model
        with pytest.raises(openai.BadRequestError) as bad:
            await sdk.files.create(file=("bad.jsonl", BAD_PAIRS), purpose="fine-tune")
        assert "line 2" in bad.value.message and '"rejected"' in bad.value.message
        pairs = await sdk.files.create(file=("pairs.jsonl", PAIRS), purpose="fine-tune")
        method = {"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.2, "n_epochs": 2}}}
        job = await sdk.fine_tuning.jobs.create(
            model=parent.fine_tuned_model, training_file=pairs.id, method=method,  # type: ignore[arg-type]
            extra_body={"lorafleet": {"node": "node-1", "gpu_memory_mib": 1000}},
        )  # fmt: skip
        assert job.method is not None and job.method.type == "dpo" and job.method.dpo
        hp = job.method.dpo.hyperparameters
        assert hp is not None and (hp.beta, hp.n_epochs) == (0.2, 2)
        assert job.model == parent.fine_tuned_model
        assert job.lorafleet["parent_job"] == parent.id  # type: ignore[attr-defined]
        done = await wait_status(sdk, job.id, "succeeded", "failed")
        assert done.status == "succeeded", done
        assert done.fine_tuned_model == f"ft:tiny::{done.id.removeprefix('ftjob-')}"
        events = [e async for e in sdk.fine_tuning.jobs.list_events(job.id, limit=100)]
        metrics = [cast(dict[str, Any], e.data) for e in events if e.type == "metrics" and e.data]
        assert metrics and all({"margin", "accuracy"} <= set(m) for m in metrics), metrics
        assert any("eval_margin" in m and "eval_accuracy" in m for m in metrics), metrics
        # Another key may not start from alice's model (with a file of its own).
        bobs = await bob.files.create(file=("pairs.jsonl", PAIRS), purpose="fine-tune")
        with pytest.raises(openai.NotFoundError) as foreign:
            await bob.fine_tuning.jobs.create(
                model=parent.fine_tuned_model,
                training_file=bobs.id,
                method=method,  # type: ignore[arg-type]
            )
        assert "no fine-tuned model" in foreign.value.message, foreign.value.message
    record = await gateway.stack.get(done.id.removeprefix("ftjob-"))
    assert record.model == "tiny" and record.resume_from == parent.id.removeprefix("ftjob-")
    assert (record.params.method, record.params.beta, record.params.epochs) == ("dpo", 0.2, 2)


async def test_what_a_dpo_job_refuses(gateway: Gateway) -> None:
    async with gateway.sdk() as sdk:
        sft_file = await sdk.files.create(file=("sft.jsonl", DATA), purpose="fine-tune")
        with pytest.raises(openai.BadRequestError) as rl:
            await sdk.fine_tuning.jobs.create(
                model="tiny", training_file=sft_file.id,
                method={"type": "reinforcement"},
            )  # fmt: skip
        assert '"supervised" or "dpo"' in rl.value.message and rl.value.param == "method.type"
        with pytest.raises(openai.BadRequestError) as kind:
            await sdk.fine_tuning.jobs.create(
                model="tiny", training_file=sft_file.id, method={"type": "dpo"},
                extra_body={"lorafleet": {"node": "node-1", "gpu_memory_mib": 1000}},
            )  # fmt: skip
        assert "line 1" in kind.value.message and "method is dpo" in kind.value.message
