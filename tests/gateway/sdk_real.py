"""The fine-tuning flow through the official openai SDK, unmodified, on the
real parts: a gateway routing by the serving records alone (no
LORAFLEET_GATEWAY_ENGINES), the stack, an agent running the REAL trainer
and serving into the session's real CPU vLLM.

files.create -> fine_tuning.jobs.create -> retrieve until succeeded ->
list_events (steps and losses) -> checkpoints.list -> chat, plain and
streamed, with job.fine_tuned_model, greedy: the same tokens the engine
gives asked directly under the adapter's served name. The first chat is
sent the moment the first `succeeded` is read, once, as an OpenAI client
does: it answers (the gateway waits while the adapter loads:
gateway/adapter_wait.py), no 404 and no retry. After unserving, the 404
says it was unloaded.

The checks are run by tests/system/test_real_serving.py, whose first job
is this one: the stack, the agent and the real training are paid once for
both.
"""

from __future__ import annotations

import json

import openai
from openai import AsyncOpenAI
from openai.types.fine_tuning import FineTuningJob

from lorafleet.nats import _bus as bus
from lorafleet_schemas.messages import NodeServeReply, NodeUnserveRequest
from lorafleet_services.agent.serving.running_engines import VllmServer
from lorafleet_services.agent.serving.vllm_adapters import loaded_adapters
from lorafleet_services.agent.serving.vllm_client import VllmClient
from tests.eventually import eventually
from tests.gateway.conftest import sdk_for
from tests.procs import ServiceProcess
from tests.system.conftest import Stack
from tests.vllm_server import RunningVllm

#: Short records: the tiny job's cost is its imports, not its steps.
DATA = "".join(
    json.dumps({"messages": [{"role": "user", "content": f"{i}+{i}?"},
                             {"role": "assistant", "content": str(2 * i)}]}) + "\n"
    for i in range(8)
).encode()  # fmt: skip
#: Seconds the real trainer (in the vLLM's Python) has to succeed on two busy
#: cores (imports dominate).
JOB_TIMEOUT_S = 600.0
#: Seconds between two polls of the job or the model through the SDK.
POLL_S = 0.5
PROMPT = "3+3?"
FINAL = ("succeeded", "failed", "cancelled")


def job_id_of(job: FineTuningJob) -> str:
    """lorafleet's job id of the SDK's job."""
    return job.id.removeprefix("ftjob-")


async def greedy(sdk: AsyncOpenAI, model: str) -> str | None:
    """The engine's greedy answer to PROMPT, the same for the same adapter."""
    reply = await sdk.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPT}], temperature=0.0,
        max_tokens=8, seed=0,
    )  # fmt: skip
    return reply.choices[0].message.content


async def refusal(sdk: AsyncOpenAI, model: str) -> openai.NotFoundError | None:
    """The 404 while `model` is served nowhere; None once it answers."""
    try:
        await greedy(sdk, model)
    except openai.NotFoundError as e:
        return e
    return None


def says_what_to_do(e: openai.NotFoundError, hint: str) -> bool:
    """OpenAI's 404 shape for a model served nowhere, its message with `hint`."""
    return (e.code, e.param) == ("model_not_found", "model") and hint in e.message


async def trained(sdk: AsyncOpenAI, node: str, rank: int) -> tuple[FineTuningJob, str | None]:
    """Upload, create on `node`, poll until succeeded, chat with its model
    at once (`first_chat`); its events and checkpoints. The job and the answer."""
    uploaded = await sdk.files.create(file=("sums.jsonl", DATA), purpose="fine-tune")
    assert (uploaded.filename, uploaded.bytes) == ("sums.jsonl", len(DATA))
    assert (await sdk.files.content(uploaded.id)).content == DATA
    created = await sdk.fine_tuning.jobs.create(
        model="tiny-llama", training_file=uploaded.id, suffix="sums", seed=3,
        metadata={"team": "qa"},
        method={"type": "supervised", "supervised": {"hyperparameters": {"batch_size": 2}}},
        extra_body={"lorafleet": {"node": node, "rank": rank, "max_steps": 2,
                                  "gpu_memory_mib": 1000}},
    )  # fmt: skip
    done = await eventually(
        lambda: sdk.fine_tuning.jobs.retrieve(created.id), f"{created.id} to end",
        until=lambda j: j.status in FINAL, timeout_s=JOB_TIMEOUT_S, interval_s=POLL_S,
    )  # fmt: skip
    assert done.status == "succeeded", done
    answer = await first_chat(sdk, done.fine_tuned_model or "")
    assert (done.seed, done.metadata, done.hyperparameters.batch_size) == (3, {"team": "qa"}, 2)
    assert done.fine_tuned_model == f"ft:tiny-llama:sums:{job_id_of(created)}"
    # The trainer's done summary (tokens_seen) -> the job record -> the job object.
    assert done.trained_tokens is not None and done.trained_tokens > 0, done

    events = [e async for e in sdk.fine_tuning.jobs.list_events(created.id, limit=5)]
    metrics = [e.data for e in events if e.type == "metrics" and isinstance(e.data, dict)]
    assert sorted(d["step"] for d in metrics) == [1, 2], events
    assert all(isinstance(d["train_loss"], float) and d["train_loss"] > 0 for d in metrics)
    checkpoints = [c async for c in sdk.fine_tuning.jobs.checkpoints.list(created.id)]
    assert [c.fine_tuned_model_checkpoint for c in checkpoints] == [done.fine_tuned_model]
    return done, answer


async def first_chat(sdk: AsyncOpenAI, model: str) -> str | None:
    """The greedy answer to the one chat sent right after `succeeded`: no
    retry (a 404 here fails the test, as it would fail a client)."""
    return await greedy(sdk, model)


async def answers_as_the_engine(
    sdk: AsyncOpenAI, done: FineTuningJob, answer: str | None, vllm: RunningVllm,
    engine: VllmClient,
) -> None:  # fmt: skip
    """The gateway's answer is the adapter's: what the engine says asked
    directly under the served name (which the client never sees). The
    engine holds this adapter only."""
    model = done.fine_tuned_model or ""
    (served_name,) = loaded_adapters(VllmServer(url=engine.url), await engine.models())
    assert served_name.startswith(job_id_of(done))
    async with sdk_for(vllm.url, "unused") as direct:
        assert answer and answer == await greedy(direct, served_name)
    stream = await sdk.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPT}], stream=True,
        temperature=0.0, max_tokens=8, seed=0,
    )  # fmt: skip
    pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
    assert "".join(pieces) == answer and len(pieces) > 1
    listed = {m.id: m.model_extra or {} for m in (await sdk.models.list()).data}
    assert listed[model]["served_by"] == listed["tiny-llama"]["served_by"] == [f"{vllm.url}/v1"]
    # The base goes to the engine by the node's heartbeat, under the engine's name for it.
    said = await sdk.completions.create(model="tiny-llama", prompt="1+1", max_tokens=4, seed=0,
                                        temperature=0.0)  # fmt: skip
    async with sdk_for(vllm.url, "unused") as direct:
        base = await direct.completions.create(
            model=str(vllm.model_dir), prompt="1+1", max_tokens=4, seed=0, temperature=0.0
        )
    assert said.choices[0].text == base.choices[0].text


async def unserved(
    stack: Stack, sdk: AsyncOpenAI, done: FineTuningJob, vllm: RunningVllm, node: str
) -> None:
    """Unserved through the node's API: the 404 then says it was unloaded."""
    reply = await bus.request(
        stack.nc, stack.settings.names.node_unserve(node),
        NodeUnserveRequest(job_id=job_id_of(done)), NodeServeReply,
    )  # fmt: skip
    assert reply.engines == [vllm.url]
    model = done.fine_tuned_model or ""

    async def refused() -> openai.NotFoundError | None:
        return await refusal(sdk, model)

    # Until the gateway's view is renewed (its TTL) a request may still reach
    # the engine, whose own 404 names the served name: wait for the gateway's.
    hint = f"was unloaded from {vllm.url} (unserved on request)"
    gone: openai.NotFoundError | None = await eventually(
        refused, "the gateway's 404 for the unserved model",
        until=lambda e: e is not None and says_what_to_do(e, hint),
    )  # fmt: skip
    assert gone is not None and says_what_to_do(gone, hint), gone and gone.body


def print_serving_lines(*procs: ServiceProcess) -> None:
    """Each process's serving lines and warnings (shown when a test fails)."""
    for proc in procs:
        told = [
            ln for ln in proc.lines if "serv" in ln.get("event", "") or ln.get("level") != "info"
        ]
        print(f"{proc.module}'s serving lines and warnings:", *told[-20:], sep="\n")
