"""A project's own, through the unmodified openai SDK on a real stack
(tests/gateway/conftest.py): another project's key gets OpenAI's 404 for
the files, jobs, checkpoints and fine-tuned model of the first (chat,
retrieve, models.list); a second key of the same project shares them; a key
revoked with the real `lorafleet auth api-key revoke` gets 401; the
quotas' 429s name the quota and its limit; cancelling a job that ended is a
400 naming its status; and the first chat right after `succeeded`, sent
once, answers while the adapter is still being loaded (the test plays the
agent: loading, then the load into the engine process, then served)."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import subprocess
import sys

import httpx2
import openai
import pytest
from openai import AsyncOpenAI

from lorafleet.nats import _bus as bus
from lorafleet_schemas.messages import Engine, ServingReport, ServingState
from lorafleet_services.gateway.api_keys import make_key
from tests.gateway.conftest import Gateway, sdk_for
from tests.gateway.engine import answer_of
from tests.gateway.test_fleet_routing import NODE, PROMPT, beating
from tests.gateway.test_sdk_flow import DATA, wait_status

pytestmark = pytest.mark.asyncio(loop_scope="module")

#: The quotas of this module's gateway: two jobs in flight, and room for
#: two uploads of DATA (a request's length counts its multipart framing too).
JOBS_QUOTA = 2
BYTES_QUOTA = 2 * len(DATA) + 2000
#: Where a job waits forever (no such node): in flight until cancelled.
NOWHERE = {"lorafleet": {"node": "nowhere", "gpu_memory_mib": 10}}


@pytest.fixture(scope="module")
def gateway_env() -> dict[str, str]:
    return {
        "LORAFLEET_GATEWAY_MAX_JOBS_IN_FLIGHT_PER_PROJECT": str(JOBS_QUOTA),
        "LORAFLEET_GATEWAY_MAX_UPLOAD_BYTES_PER_PROJECT": str(BYTES_QUOTA),
    }


async def chat(sdk: AsyncOpenAI, model: str) -> str | None:
    reply = await sdk.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPT}]
    )
    return reply.choices[0].message.content


async def play_the_agent(gateway: Gateway, job_id: str, served_name: str) -> None:
    """What the agent does after a job: report loading, load into the
    engine, report served (the engine process's answer names the adapter)."""
    engine_url = gateway.engine.base_url.removesuffix("/v1")
    names = gateway.stack.settings.names
    for seq, state in enumerate((ServingState.LOADING, ServingState.SERVED), start=1):
        if state is ServingState.SERVED:
            async with httpx2.AsyncClient() as http:
                loaded = await http.post(
                    f"{gateway.engine.base_url}/load_lora_adapter",
                    json={"lora_name": served_name, "lora_path": "/adapters/x"},
                )
            assert loaded.status_code == 200, loaded.text
        r = ServingReport(
            job_id=job_id, node=NODE, engine=engine_url, engine_kind=Engine.VLLM,
            model="tiny", served_name=served_name, sha256="e" * 64, state=state, seq=seq,
            time=dt.datetime.now(dt.UTC),
        )  # fmt: skip
        await gateway.stack.js.publish(names.serving_report(NODE, job_id), bus.encode(r))


async def lorafleet(gateway: Gateway, *args: str) -> subprocess.CompletedProcess[str]:
    """The real `lorafleet auth api-key ...` on the gateway's keys file, in a
    thread: the test's event loop beats for the node meanwhile."""
    argv = [sys.executable, "-m", "lorafleet_services.cli", "auth", "api-key", *args]
    return await asyncio.to_thread(
        subprocess.run,
        [*argv, "--file", str(gateway.keys_file)],
        capture_output=True,
        text=True,
        timeout=60,
    )


async def test_a_projects_model_is_its_own(gateway: Gateway) -> None:
    engine_url = gateway.engine.base_url.removesuffix("/v1")
    carol_key = make_key(gateway.keys_file, "carol", project="alice")
    async with gateway.sdk() as alice, gateway.sdk("bob") as bob, beating(gateway, engine_url):
        uploaded = await alice.files.create(file=("pairs.jsonl", DATA), purpose="fine-tune")
        created = await alice.fine_tuning.jobs.create(
            model="tiny", training_file=uploaded.id, suffix="own",
            extra_body={"lorafleet": {"node": "node-1", "gpu_memory_mib": 1000}},
        )  # fmt: skip
        done = await wait_status(alice, created.id, "succeeded", "failed")
        assert done.status == "succeeded" and done.fine_tuned_model, done
        model, job_id = done.fine_tuned_model, created.id.removeprefix("ftjob-")
        served_name = f"{job_id}-{'e' * 12}"

        # Succeeded means usable: the first chat, sent once now, waits for the load.
        first = asyncio.create_task(chat(alice, model))
        await play_the_agent(gateway, job_id, served_name)
        assert await first == answer_of(served_name, PROMPT)

        await another_projects_key_finds_nothing(bob, model, uploaded.id, created.id, served_name)
        async with sdk_for(gateway.url, carol_key) as carol:
            await the_same_project_shares(carol, model, uploaded.id, created.id, served_name)

            with pytest.raises(openai.BadRequestError) as ended:
                await alice.fine_tuning.jobs.cancel(created.id)
            assert ended.value.param == "fine_tuning_job_id"
            assert "it is succeeded" in ended.value.message, ended.value.message
            assert (await alice.fine_tuning.jobs.retrieve(created.id)).status == "succeeded"

            listed = await lorafleet(gateway, "list", "--json")
            assert listed.returncode == 0, listed.stderr
            keys = {k["name"]: k["project"] for k in json.loads(listed.stdout)}
            assert [keys.get(k) for k in ("alice", "bob", "carol")] == ["alice", "bob", "alice"]
            revoked = await lorafleet(gateway, "revoke", "carol")
            assert revoked.returncode == 0, revoked.stderr
            with pytest.raises(openai.AuthenticationError) as refused:
                await carol.models.list()
            assert refused.value.status_code == 401
            again = await lorafleet(gateway, "revoke", "carol")
            assert again.returncode == 1 and "no API key 'carol'" in again.stderr, again.stderr


async def another_projects_key_finds_nothing(
    bob: AsyncOpenAI, model: str, file_id: str, job_id: str, served_name: str
) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        await chat(bob, model)
    assert (caught.value.code, caught.value.param) == ("model_not_found", "model")
    # Nor by the name the engine lists it under (a configured engine's models).
    with pytest.raises(openai.NotFoundError) as by_engine_name:
        await chat(bob, served_name)
    assert by_engine_name.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        await bob.fine_tuning.jobs.retrieve(job_id)
    with pytest.raises(openai.NotFoundError):
        await bob.fine_tuning.jobs.checkpoints.list(job_id)
    with pytest.raises(openai.NotFoundError):
        await bob.fine_tuning.jobs.list_events(job_id)
    with pytest.raises(openai.NotFoundError):
        await bob.fine_tuning.jobs.cancel(job_id)
    with pytest.raises(openai.NotFoundError):
        await bob.files.retrieve(file_id)
    with pytest.raises(openai.NotFoundError):
        await bob.files.content(file_id)
    with pytest.raises(openai.NotFoundError):
        await bob.fine_tuning.jobs.create(model="tiny", training_file=file_id)
    seen = {m.id for m in (await bob.models.list()).data}
    assert "tiny" in seen and model not in seen and served_name not in seen, seen
    assert job_id not in {j.id async for j in bob.fine_tuning.jobs.list()}


async def the_same_project_shares(
    carol: AsyncOpenAI, model: str, file_id: str, job_id: str, served_name: str
) -> None:
    assert await chat(carol, model) == answer_of(served_name, PROMPT)
    assert await chat(carol, served_name) == answer_of(served_name, PROMPT)
    assert (await carol.fine_tuning.jobs.retrieve(job_id)).fine_tuned_model == model
    checkpoints = carol.fine_tuning.jobs.checkpoints.list(job_id)
    assert [c.fine_tuned_model_checkpoint async for c in checkpoints] == [model]
    assert (await carol.files.retrieve(file_id)).id == file_id
    assert model in {m.id for m in (await carol.models.list()).data}


async def test_a_projects_quotas_are_429s_that_name_them(gateway: Gateway) -> None:
    key = make_key(gateway.keys_file, "quota-1", project="quotas")
    async with sdk_for(gateway.url, key) as sdk:
        files = [await sdk.files.create(file=("p.jsonl", DATA), purpose="fine-tune")]
        files.append(await sdk.files.create(file=("p.jsonl", DATA), purpose="fine-tune"))
        with pytest.raises(openai.RateLimitError) as over:
            await sdk.files.create(file=("p.jsonl", DATA), purpose="fine-tune")
        assert over.value.code == "quota_exceeded"
        assert f"bytes uploaded is {BYTES_QUOTA}" in over.value.message, over.value.message
        assert "MAX_UPLOAD_BYTES_PER_PROJECT" in over.value.message
        await sdk.files.delete(files[1].id)  # its bytes are free again
        await sdk.files.create(file=("p.jsonl", DATA), purpose="fine-tune")

        jobs = []
        for _ in range(JOBS_QUOTA):
            jobs.append(
                await sdk.fine_tuning.jobs.create(
                    model="tiny", training_file=files[0].id, extra_body=NOWHERE
                )
            )
        with pytest.raises(openai.RateLimitError) as over:
            await sdk.fine_tuning.jobs.create(
                model="tiny", training_file=files[0].id, extra_body=NOWHERE
            )
        assert f"jobs in flight is {JOBS_QUOTA}" in over.value.message, over.value.message
        await sdk.fine_tuning.jobs.cancel(jobs[0].id)  # one slot free again
        jobs.append(
            await sdk.fine_tuning.jobs.create(
                model="tiny", training_file=files[0].id, extra_body=NOWHERE
            )
        )
        for job in jobs[1:]:
            await sdk.fine_tuning.jobs.cancel(job.id)


async def test_requests_at_once_do_not_pass_a_quota(gateway: Gateway) -> None:
    """Each request checked before any is counted would all pass: the ones
    the bucket's order puts past the quota are refused after the fact, their
    file or job undone, and exactly the quota is made."""
    key = make_key(gateway.keys_file, "burst-1", project="burst")
    async with sdk_for(gateway.url, key) as sdk:
        uploads = await asyncio.gather(
            *(sdk.files.create(file=("p.jsonl", DATA), purpose="fine-tune") for _ in range(4)),
            return_exceptions=True,
        )
        made = [u for u in uploads if not isinstance(u, BaseException)]
        refused = [u for u in uploads if isinstance(u, openai.RateLimitError)]
        assert (len(made), len(refused)) == (2, 2), uploads
        listed = [f.id async for f in sdk.files.list()]
        assert sorted(listed) == sorted(f.id for f in made)

        creates = await asyncio.gather(
            *(
                sdk.fine_tuning.jobs.create(
                    model="tiny", training_file=made[0].id, extra_body=NOWHERE
                )
                for _ in range(2 * JOBS_QUOTA)
            ),
            return_exceptions=True,
        )
        jobs = [c for c in creates if not isinstance(c, BaseException)]
        refused = [c for c in creates if isinstance(c, openai.RateLimitError)]
        assert (len(jobs), len(refused)) == (JOBS_QUOTA, JOBS_QUOTA), creates
        assert "jobs in flight" in refused[0].message
        listed_jobs = [j.id async for j in sdk.fine_tuning.jobs.list()]
        assert sorted(listed_jobs) == sorted(j.id for j in jobs)
        # The refused ones are not in flight: one slot frees with one cancel.
        await sdk.fine_tuning.jobs.cancel(jobs[0].id)
        again = await sdk.fine_tuning.jobs.create(
            model="tiny", training_file=made[0].id, extra_body=NOWHERE
        )
        for job in [*jobs[1:], again]:
            await sdk.fine_tuning.jobs.cancel(job.id)
