"""Every error path through the SDK's own exception classes, each in
OpenAI's error shape with the status the SDK maps to that class."""

from __future__ import annotations

import json

import msgspec
import openai
import pytest

from lorafleet_services.gateway.state import GatewayState
from tests.eventually import eventually
from tests.gateway.conftest import Gateway

pytestmark = pytest.mark.asyncio(loop_scope="module")

GOOD = b'{"q": "what is 1+1?", "a": "2"}\n' * 4


@pytest.fixture(scope="module")
def gateway_env() -> dict[str, str]:
    return {"LORAFLEET_GATEWAY_MAX_REQUESTS_PER_KEY": "1"}


async def test_a_missing_or_unknown_key_is_an_authentication_error(gateway: Gateway) -> None:
    async with gateway.sdk("not-a-key") as sdk:
        with pytest.raises(openai.AuthenticationError) as caught:
            await sdk.files.list()
    assert caught.value.status_code == 401
    assert caught.value.code == "invalid_api_key"
    assert "lorafleet auth api-key create" in caught.value.message


async def test_what_does_not_exist_is_not_found(gateway: Gateway) -> None:
    async with gateway.sdk() as sdk:
        with pytest.raises(openai.NotFoundError, match="no fine-tuning job"):
            await sdk.fine_tuning.jobs.retrieve("ftjob-0000")
        with pytest.raises(openai.NotFoundError, match="no file"):
            await sdk.files.retrieve("file-nope")
        with pytest.raises(openai.NotFoundError) as caught:
            await sdk.fine_tuning.jobs.create(model="tiny", training_file="file-nope")
        assert caught.value.param == "training_file"
        good = await sdk.files.create(file=("a.jsonl", GOOD), purpose="fine-tune")
        with pytest.raises(openai.NotFoundError, match="validation_file: no file") as caught:
            await sdk.fine_tuning.jobs.create(
                model="tiny", training_file=good.id, validation_file="file-nope"
            )
        assert caught.value.param == "validation_file"
        with pytest.raises(openai.NotFoundError) as caught:
            await sdk.chat.completions.create(
                model="ft:nowhere::x", messages=[{"role": "user", "content": "hi"}]
            )
        assert caught.value.code == "model_not_found" and "is not this project's" in str(
            caught.value.message
        )
        with pytest.raises(openai.NotFoundError) as caught:
            await sdk.get("/assistants", cast_to=object)
        assert caught.value.code == "unknown_route"
        # Another key's file is not found, not forbidden: it is not there for this key.
        uploaded = await sdk.files.create(file=("a.jsonl", GOOD), purpose="fine-tune")
    async with gateway.sdk("bob") as bob:
        with pytest.raises(openai.NotFoundError):
            await bob.files.retrieve(uploaded.id)


async def test_wrong_requests_are_bad_requests_naming_the_fix(gateway: Gateway) -> None:
    async with gateway.sdk() as sdk:
        with pytest.raises(openai.BadRequestError) as caught:
            await sdk.files.create(file=("a.jsonl", GOOD), purpose="assistants")
        assert caught.value.param == "purpose"
        broken = GOOD + b'{"q": "no answer"}\n'
        with pytest.raises(openai.BadRequestError, match=r'line 5: the record has no "a"'):
            await sdk.files.create(file=("a.jsonl", broken), purpose="fine-tune")
        uploaded = await sdk.files.create(file=("a.jsonl", GOOD), purpose="fine-tune")
        # A file of another purpose (no upload makes one yet: put as a future
        # gateway version could) is no job's data.
        state = await GatewayState.open(
            gateway.stack.js, gateway.stack.settings.names.gateway_bucket
        )
        kept = await state.file("alice", uploaded.id)
        assert kept is not None
        other = msgspec.structs.replace(kept, id="file-batch0", purpose="batch")
        await state.put_file("alice", other)
        for param in ("validation_file", "training_file"):
            files = {"training_file": uploaded.id, param: other.id}
            with pytest.raises(openai.BadRequestError, match="purpose 'batch'") as caught:
                await sdk.fine_tuning.jobs.create(model="tiny", **files)  # type: ignore[arg-type]
            assert caught.value.param == param
        with pytest.raises(
            openai.BadRequestError, match=r"<= 1000 - at `\$.hyperparameters.n_epochs`"
        ):
            await sdk.fine_tuning.jobs.create(
                model="tiny", training_file=uploaded.id, hyperparameters={"n_epochs": 5000}
            )
        with pytest.raises(openai.BadRequestError, match="rnak"):
            await sdk.fine_tuning.jobs.create(
                model="tiny", training_file=uploaded.id, extra_body={"lorafleet": {"rnak": 8}}
            )
        with pytest.raises(openai.NotFoundError) as caught:
            await sdk.fine_tuning.jobs.create(model="not-in-catalog", training_file=uploaded.id)
        assert "not-in-catalog" in caught.value.message
        with pytest.raises(openai.BadRequestError) as caught:
            await sdk.fine_tuning.jobs.list(after="ftjob-unknown")
        assert caught.value.param == "after"


async def test_resuming_what_is_not_paused_is_a_conflict(gateway: Gateway) -> None:
    async with gateway.sdk() as sdk:
        uploaded = await sdk.files.create(file=("a.jsonl", GOOD), purpose="fine-tune")
        job = await sdk.fine_tuning.jobs.create(
            model="tiny", training_file=uploaded.id,
            extra_body={"lorafleet": {"node": "nowhere", "gpu_memory_mib": 10}},
        )  # fmt: skip
        with pytest.raises(openai.ConflictError, match="not paused"):
            await sdk.fine_tuning.jobs.resume(job.id)
        with pytest.raises(openai.ConflictError, match="no checkpoint"):
            await sdk.fine_tuning.jobs.pause(job.id)
        await sdk.fine_tuning.jobs.cancel(job.id)


async def test_a_key_with_too_many_requests_in_flight_is_rate_limited(gateway: Gateway) -> None:
    await gateway.stack.call(gateway.stack.settings.names.models_list, {})  # the stack is up
    async with gateway.sdk() as sdk:
        stream = await sdk.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "a long answer"}], stream=True
        )
        with pytest.raises(openai.RateLimitError) as caught:
            await sdk.files.list()  # while the stream holds this key's one slot
        assert caught.value.status_code == 429
        await stream.close()
        # The slot is free once the gateway's relay of the stream has ended.
        listed = await eventually(
            sdk.files.list, "the key's slot to be free", retry_on=(openai.RateLimitError,),
            timeout_s=5.0,
        )  # fmt: skip
        assert listed.object == "list"


async def test_a_control_plane_that_does_not_answer_is_unavailable(gateway: Gateway) -> None:
    await gateway.stack.recorder.stop()
    async with gateway.sdk() as sdk:
        with pytest.raises(openai.InternalServerError) as caught:
            await sdk.models.list()
        raw = caught.value.response.json()
    assert caught.value.status_code == 503
    assert set(raw["error"]) == {"message", "type", "param", "code"}
    assert "retry" in json.dumps(raw)
