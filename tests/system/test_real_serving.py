"""Trained, then served, on the real CPU vLLM: the whole stack (recorder,
scheduler, artifact-store) and a real agent whose trainer runs in the vLLM's
own Python (the engines cache laid out as a node's engines directory), the
session's vLLM server (tests/vllm_server.py) as the node's engine.

One test, in phases, so that the overlay install, the agent start and the
stack are paid once: the first job is the openai SDK's fine-tuning flow
through a real gateway (tests/gateway/sdk_real.py: files, job, events,
checkpoints, the first chat sent once right after `succeeded`, plain and
streamed, the 404 after unserving); it ends `done` and its adapter is
served (loading -> served, the probe within tolerance of PEFT); a rank over --max-lora-rank is a
`refused` report and the job stays done; a second job's version gets a new
name; an adapter the engine lost is loaded again within a measured bound
(the short version of an engine restart: bench/serving_restart.py restarts
a real engine); a third version evicts the least recently served; unserve
takes it out of /v1/models and its staged copy off the disk; node.serve
fetches an evicted version from the store and serves it again.
The session's engine is left serving no adapter.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

import msgspec
import pytest
from openai import AsyncOpenAI

from lorafleet.nats import _bus as bus
from lorafleet_schemas.messages import (
    JobState,
    ModelList,
    NodeServeReply,
    NodeServeRequest,
    NodeUnserveRequest,
    ServingReport,
    ServingState,
)
from lorafleet_services.agent.serving.running_engines import VllmServer
from lorafleet_services.agent.serving.vllm_adapters import PROBE_TOLERANCE, loaded_adapters
from lorafleet_services.agent.serving.vllm_client import VllmClient
from lorafleet_services.gateway.api_keys import make_key
from lorafleet_services.local import vllm_cpu
from lorafleet_trainer.probe import PROBE_FILE
from tests.eventually import eventually
from tests.gateway import sdk_real
from tests.gateway.conftest import gateway_on, sdk_for
from tests.serving_reports import SERVE_TIMEOUT_S, ServingReports, of
from tests.system.conftest import Stack
from tests.vllm_server import RunningVllm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

#: Training in the vLLM Python: tens of seconds on two busy cores.
JOB_TIMEOUT_S = 600.0
PARAMS = {"max_steps": 2, "batch_size": 2, "max_seq_len": 64, "alpha": 8}


def settled(job_id: str) -> Callable[[ServingReport], bool]:
    """The end of one load: served, refused or failed."""
    return of(job_id, ServingState.SERVED, ServingState.REFUSED, ServingState.FAILED)


@pytest.fixture
async def engine_client(vllm_server: RunningVllm) -> AsyncIterator[VllmClient]:
    async with VllmClient(vllm_server.url) as c:
        yield c
        for name in loaded_adapters(VllmServer(url=c.url), await c.models()):
            await c.unload_lora_adapter(name)


async def loaded(client: VllmClient) -> list[str]:
    return sorted(loaded_adapters(VllmServer(url=client.url), await client.models()))


async def test_trained_jobs_are_served_kept_and_unserved(
    stack: Stack, vllm_server: RunningVllm, engine_client: VllmClient
) -> None:
    names = stack.settings.names
    model = {"name": "tiny-llama", "engine": "vllm", "local_dir": str(vllm_server.model_dir)}
    await stack.call(names.models_add, model)
    # No python: the agent finds `<engines_dir>/vllm/0.32.0/bin/python3`, the real vLLM's.
    agent = await stack.agent(
        "node-1", trainer="real", engines_dir=vllm_cpu.engines_cache(), hf_offline=True,
        vllm_servers=(vllm_server.url,), engines_refresh_s=1.0,
    )  # fmt: skip
    reports = await ServingReports.of_node(stack.js, names, "node-1")
    keys_file = stack.tmp_path / "keys.json"
    key = make_key(keys_file, "alice")
    try:
        # A load with its PEFT probe takes tens of seconds on two busy cores.
        wait = {"LORAFLEET_GATEWAY_ADAPTER_LOAD_WAIT_S": str(SERVE_TIMEOUT_S)}
        async with gateway_on(stack, keys_file, wait) as (_, url), sdk_for(url, key) as sdk:
            await phases(stack, vllm_server, engine_client, reports, sdk)
    finally:  # shown when it fails: where serving stood on each side
        sdk_real.print_serving_lines(agent, stack.recorder)
    python = agent.events("trainer.started")[-1]["python"]
    assert python == str(vllm_cpu.vllm_cpu_python(vllm_cpu.engines_cache()))


async def phases(
    stack: Stack, vllm_server: RunningVllm, engine_client: VllmClient,
    reports: ServingReports, sdk: AsyncOpenAI,
) -> None:  # fmt: skip
    names = stack.settings.names

    async def trained(rank: int) -> str:
        job = await stack.submit("node-1", model="tiny-llama", params={**PARAMS, "rank": rank})
        done = await stack.wait_state(
            job.id, JobState.DONE, JobState.FAILED, JobState.CANCELLED, timeout_s=JOB_TIMEOUT_S
        )
        assert done.state is JobState.DONE, done.message
        return job.id

    # 1. Through the SDK: done, then served (loading -> served, the probe
    # within tolerance of PEFT), the gateway answering as the engine does.
    started = time.monotonic()
    sdk_job, answer = await sdk_real.trained(sdk, "node-1", rank=4)
    a = sdk_real.job_id_of(sdk_job)
    print(f"succeeded and its first chat answered after {time.monotonic() - started:.1f} s")
    loading = await reports.next(of(a, ServingState.LOADING))
    served_a = await reports.next(settled(a))
    assert served_a.state is ServingState.SERVED, served_a.reason
    assert served_a.engine == vllm_server.url and served_a.seq > loading.seq
    assert served_a.probe_error is not None and served_a.probe_error <= PROBE_TOLERANCE
    print(f"probe |vLLM - PEFT| max: {served_a.probe_error:.3g}")
    (artifact,) = (await stack.call(names.artifacts_list, {"job_id": a}))["artifacts"]
    assert served_a.sha256 == artifact["sha256"] and served_a.served_name.startswith(a)
    assert await loaded(engine_client) == [served_a.served_name]
    # The trainer's PEFT reference came with the adapter (staged with it).
    served_dir = stack.tmp_path / "agent-node-1" / "served"
    assert (served_dir / served_a.served_name / PROBE_FILE).is_file()
    await sdk_real.answers_as_the_engine(sdk, sdk_job, answer, vllm_server, engine_client)

    # 2. A rank over --max-lora-rank: refused, naming the flag; the job stays done.
    b = await trained(32)
    refused = await reports.next(settled(b))
    assert (refused.state, refused.lift) == (ServingState.REFUSED, "--max-lora-rank 32")
    assert "over the engine's --max-lora-rank 16" in refused.reason
    assert (await stack.get(b)).state is JobState.DONE

    # 3. A second version: a new name, both loaded (the engine holds two).
    c = await trained(4)
    served_c = await reports.next(settled(c))
    assert served_c.state is ServingState.SERVED, served_c.reason
    assert served_c.served_name != served_a.served_name
    assert await loaded(engine_client) == sorted([served_a.served_name, served_c.served_name])

    # 4. The engine loses A (what a restart does to runtime loads): loaded again.
    await engine_client.unload_lora_adapter(served_a.served_name)
    lost_at = time.monotonic()
    again = await reports.next(settled(a))
    bound_s = time.monotonic() - lost_at
    assert again.state is ServingState.SERVED and served_a.served_name in await loaded(
        engine_client
    )
    print(f"lost -> served again: {bound_s:.1f} s (refresh 1 s)")

    # 5. A third version with both slots taken: the least recently served (C) goes.
    d = await trained(4)
    evicted = await reports.next(of(c, ServingState.UNLOADED))
    served_d = await reports.next(settled(d))
    assert served_d.state is ServingState.SERVED, served_d.reason
    assert evicted.reason == f"evicted for {served_d.served_name}"
    assert await loaded(engine_client) == sorted([served_a.served_name, served_d.served_name])

    # 6. Unserve: out of /v1/models, its staged copy gone.
    assert (served_dir / served_d.served_name).is_dir()
    reply = await bus.request(
        stack.nc, names.node_unserve("node-1"), NodeUnserveRequest(job_id=d), NodeServeReply
    )
    assert reply.engines == [vllm_server.url]
    unloaded = await reports.next(of(d, ServingState.UNLOADED))
    assert unloaded.reason == "unserved on request"
    assert await loaded(engine_client) == [served_a.served_name]
    assert not (served_dir / served_d.served_name).exists()

    # 7. node.serve: C is no longer held here, so it is fetched from the store.
    (art_c,) = (await stack.call(names.artifacts_list, {"job_id": c}))["artifacts"]
    listed = await stack.call(names.models_list, {})
    (record,) = [m for m in msgspec.convert(listed, ModelList).models if m.name == "tiny-llama"]
    request = NodeServeRequest(
        job_id=c, model=record, object=art_c["object"], sha256=art_c["sha256"]
    )
    reply = await bus.request(stack.nc, names.node_serve("node-1"), request, NodeServeReply)
    assert reply.engines == [vllm_server.url]
    refetched = await reports.next(settled(c))
    assert refetched.state is ServingState.SERVED, refetched.reason
    assert refetched.served_name == served_c.served_name
    # The store's artifact carries the trainer's probe.json too.
    assert (served_dir / served_c.served_name / PROBE_FILE).is_file()

    # Nothing serves a model no engine runs: the reply says why, at once.
    other = msgspec.structs.replace(record, local_dir="/models/none", name="none")
    reply = await bus.request(
        stack.nc, names.node_serve("node-1"),
        NodeServeRequest(job_id=c, model=other, object="x", sha256="0" * 64), NodeServeReply,
    )  # fmt: skip
    assert reply.engines == [] and "no vLLM on node-1 serves '/models/none'" in reply.reason

    # The heartbeat carries the engine and what it holds.
    held = sorted([served_a.served_name, served_c.served_name])
    assert await loaded(engine_client) == held

    async def beat_serving() -> bool:
        nodes = (await stack.nodes()).nodes
        beat = [(e.url, sorted(e.adapters)) for n in nodes for e in n.heartbeat.serving]
        return beat == [(vllm_server.url, held)]

    await eventually(beat_serving, "the heartbeat to carry the engine and its adapters")
    # Unserved, A's fine-tuned name gets the gateway's 404 saying so.
    await sdk_real.unserved(stack, sdk, sdk_job, vllm_server, "node-1")
    await reports.next(of(a, ServingState.UNLOADED))
    await bus.request(
        stack.nc, names.node_unserve("node-1"), NodeUnserveRequest(job_id=c), NodeServeReply
    )
    await reports.next(of(c, ServingState.UNLOADED))
    assert await loaded(engine_client) == []
    assert sorted(p.name for p in served_dir.iterdir()) == ["desired.json"]
