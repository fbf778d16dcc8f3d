"""The gateway routes a fine-tuned model by the serving records: a real
ServingReport published on the status stream, written by the real recorder,
read by the real gateway through `api.adapters.list`, and the node's
heartbeat naming the engine (here a node the test beats for, whose engine
is the stand-in engine process). The engine is asked for the served name."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from collections.abc import AsyncIterator

import httpx2
import openai
import pytest

from lorafleet.nats import _bus as bus
from lorafleet_schemas.messages import (
    Engine,
    EngineRef,
    Heartbeat,
    ServingReport,
    ServingState,
)
from tests.eventually import eventually
from tests.gateway.conftest import Gateway
from tests.gateway.engine import answer_of
from tests.gateway.test_sdk_flow import DATA, wait_status

pytestmark = pytest.mark.asyncio(loop_scope="module")

NODE = "edge-1"
PROMPT = "what is 4+4?"


@contextlib.asynccontextmanager
async def beating(gateway: Gateway, engine_url: str) -> AsyncIterator[None]:
    """Heartbeats of NODE, whose one engine is `engine_url`, until the block ends."""
    stack = gateway.stack

    async def beat() -> None:
        started = dt.datetime.now(dt.UTC)
        engine = EngineRef(kind=Engine.VLLM, url=engine_url, model="tiny")
        while True:
            hb = Heartbeat(node=NODE, version="t", started_at=started,
                           time=dt.datetime.now(dt.UTC), serving=[engine])  # fmt: skip
            await stack.js.publish(
                stack.settings.names.node_heartbeat(NODE), bus.encode(hb),
                msg_ttl=stack.settings.node_timeout_s,
            )  # fmt: skip
            await asyncio.sleep(stack.settings.heartbeat_s)

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_a_fine_tuned_model_goes_where_its_serving_record_says(gateway: Gateway) -> None:
    engine_url = gateway.engine.base_url.removesuffix("/v1")
    names = gateway.stack.settings.names
    async with gateway.sdk() as sdk, beating(gateway, engine_url):
        uploaded = await sdk.files.create(file=("pairs.jsonl", DATA), purpose="fine-tune")
        created = await sdk.fine_tuning.jobs.create(
            model="tiny", training_file=uploaded.id, suffix="routed",
            extra_body={"lorafleet": {"node": "node-1", "gpu_memory_mib": 1000}},
        )  # fmt: skip
        done = await wait_status(sdk, created.id, "succeeded", "failed")
        assert done.status == "succeeded" and done.fine_tuned_model is not None, done
        model, job_id = done.fine_tuned_model, created.id.removeprefix("ftjob-")

        async def chat() -> str | None:
            reply = await sdk.chat.completions.create(
                model=model, messages=[{"role": "user", "content": PROMPT}]
            )
            return reply.choices[0].message.content

        # As the agent does: load under the adapter version's own name, then report.
        served_name = f"{job_id}-{'c' * 12}"
        async with httpx2.AsyncClient() as http:
            loaded = await http.post(
                f"{gateway.engine.base_url}/load_lora_adapter",
                json={"lora_name": served_name, "lora_path": "/adapters/x"},
            )
            assert loaded.status_code == 200

        async def report(seq: int, state: ServingState) -> None:
            r = ServingReport(
                job_id=job_id, node=NODE, engine=engine_url, engine_kind=Engine.VLLM,
                model="tiny", served_name=served_name, sha256="c" * 64, state=state, seq=seq,
                time=dt.datetime.now(dt.UTC),
            )  # fmt: skip
            await gateway.stack.js.publish(names.serving_report(NODE, job_id), bus.encode(r))

        await report(1, ServingState.SERVED)
        answer = await eventually(
            chat, "the fine-tuned model routed", retry_on=openai.NotFoundError
        )
        # The engine was asked for the served name, which the client never saw.
        assert answer == answer_of(served_name, PROMPT)
        listed = {m.id: m for m in (await sdk.models.list()).data}
        assert (listed[model].model_extra or {})["served_by"] == [gateway.engine.base_url]

        await report(2, ServingState.UNLOADED)

        async def refused() -> bool:
            with contextlib.suppress(openai.NotFoundError):
                await chat()
                return False
            return True

        await eventually(refused, "the unloaded model to be served nowhere", until=bool)
