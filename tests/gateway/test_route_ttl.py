"""Within the route cache's TTL after an unload, a chat still goes to the
engine, which answers 404 under the adapter's served name: the gateway
answers OpenAI's 404 for the fine-tuned model instead, with its own hint,
and drops the route it had kept."""

from __future__ import annotations

import datetime as dt

import httpx2
import openai
import pytest

from lorafleet.nats import _bus as bus
from lorafleet_schemas.messages import Engine, ServingReport, ServingState
from tests.eventually import eventually
from tests.gateway.conftest import Gateway
from tests.gateway.engine import answer_of
from tests.gateway.test_fleet_routing import NODE, PROMPT, beating
from tests.gateway.test_sdk_flow import DATA, wait_status

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module")
def gateway_env() -> dict[str, str]:
    # Longer than the test: only a dropped route makes the gateway read the records again.
    return {"LORAFLEET_GATEWAY_ENGINE_MODELS_TTL_S": "600"}


async def engine_adapter(gateway: Gateway, verb: str, served_name: str) -> None:
    async with httpx2.AsyncClient() as http:
        reply = await http.post(
            f"{gateway.engine.base_url}/{verb}_lora_adapter",
            json={"lora_name": served_name, "lora_path": "/adapters/x"},
        )
        assert reply.status_code == 200, reply.text


async def test_an_engine_404_in_the_ttl_is_the_gateways_own(gateway: Gateway) -> None:
    engine_url = gateway.engine.base_url.removesuffix("/v1")
    names = gateway.stack.settings.names
    async with gateway.sdk() as sdk, beating(gateway, engine_url):
        uploaded = await sdk.files.create(file=("pairs.jsonl", DATA), purpose="fine-tune")
        created = await sdk.fine_tuning.jobs.create(
            model="tiny", training_file=uploaded.id, suffix="ttl",
            extra_body={"lorafleet": {"node": "node-1", "gpu_memory_mib": 1000}},
        )  # fmt: skip
        done = await wait_status(sdk, created.id, "succeeded", "failed")
        assert done.fine_tuned_model is not None, done
        model, job_id = done.fine_tuned_model, created.id.removeprefix("ftjob-")
        served_name = f"{job_id}-{'d' * 12}"

        async def report(seq: int, state: ServingState) -> None:
            r = ServingReport(
                job_id=job_id, node=NODE, engine=engine_url, engine_kind=Engine.VLLM,
                model="tiny", served_name=served_name, sha256="d" * 64, state=state, seq=seq,
                time=dt.datetime.now(dt.UTC), reason="asked to by the test",
            )  # fmt: skip
            await gateway.stack.js.publish(names.serving_report(NODE, job_id), bus.encode(r))

        async def chat() -> str | None:
            reply = await sdk.chat.completions.create(
                model=model, messages=[{"role": "user", "content": PROMPT}]
            )
            return reply.choices[0].message.content

        await engine_adapter(gateway, "load", served_name)
        await report(1, ServingState.SERVED)
        answer = await eventually(chat, "the model routed", retry_on=openai.NotFoundError)
        assert answer == answer_of(served_name, PROMPT)  # the route is kept from here on

        await engine_adapter(gateway, "unload", served_name)
        await report(2, ServingState.UNLOADED)
        await eventually(
            lambda: gateway.stack.call(names.adapters_list, {"job_ids": [job_id]}),
            "the unload recorded",
            until=lambda got: [a["state"] for a in got["adapters"]] == ["unloaded"],
        )
        with pytest.raises(openai.NotFoundError) as caught:
            await chat()
        assert caught.value.code == "model_not_found" and caught.value.param == "model"
        assert "was unloaded from" in caught.value.message, caught.value.message
        assert served_name not in caught.value.message

        # The route was dropped: with the adapter back in the engine but its
        # record still unloaded, the gateway no longer sends the chat there.
        await engine_adapter(gateway, "load", served_name)
        with pytest.raises(openai.NotFoundError, match="was unloaded from"):
            await chat()
