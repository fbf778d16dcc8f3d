"""Preference tuning on a supervised job's model, then a chat with the
result, through the unmodified openai SDK on a real stack
(tests/gateway/conftest.py): the DPO job's fine-tuned model answers the
first chat sent right after `succeeded` (the test plays the agent's
serving reports; the engine process's answer names the adapter it ran)."""

from __future__ import annotations

import asyncio

import pytest

from tests.gateway.conftest import Gateway
from tests.gateway.engine import answer_of
from tests.gateway.test_fleet_routing import PROMPT, beating
from tests.gateway.test_sdk_flow import DATA, PAIRS, wait_status
from tests.gateway.test_tenancy import chat, play_the_agent

pytestmark = pytest.mark.asyncio(loop_scope="module")

ON_NODE_1 = {"lorafleet": {"node": "node-1", "gpu_memory_mib": 1000}}


async def test_a_dpo_jobs_model_answers_right_after_it_succeeded(gateway: Gateway) -> None:
    engine_url = gateway.engine.base_url.removesuffix("/v1")
    async with gateway.sdk() as sdk, beating(gateway, engine_url):
        sft_file = await sdk.files.create(file=("sft.jsonl", DATA), purpose="fine-tune")
        sft = await sdk.fine_tuning.jobs.create(
            model="tiny", training_file=sft_file.id, extra_body=ON_NODE_1
        )
        parent = await wait_status(sdk, sft.id, "succeeded", "failed")
        assert parent.status == "succeeded" and parent.fine_tuned_model, parent
        pairs = await sdk.files.create(file=("pairs.jsonl", PAIRS), purpose="fine-tune")
        job = await sdk.fine_tuning.jobs.create(
            model=parent.fine_tuned_model, training_file=pairs.id,
            method={"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.1}}},  # type: ignore[arg-type]
            extra_body=ON_NODE_1,
        )  # fmt: skip
        done = await wait_status(sdk, job.id, "succeeded", "failed")
        assert done.status == "succeeded" and done.fine_tuned_model, done
        job_id = done.id.removeprefix("ftjob-")
        served_name = f"{job_id}-{'d' * 12}"

        first = asyncio.create_task(chat(sdk, done.fine_tuned_model))
        await play_the_agent(gateway, job_id, served_name)
        assert await first == answer_of(served_name, PROMPT)
