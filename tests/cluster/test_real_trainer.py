"""The real trainer (a tiny Llama on the CPU) on the cluster, while the
heartbeat bucket's leader is SIGKILLed and restarted: the job ends done,
every step once, no node loss."""

from __future__ import annotations

import asyncio
import sys

import pytest

from lorafleet.names import kv_stream
from lorafleet.nats.cluster import NatsCluster
from lorafleet_schemas.messages import JobState
from lorafleet_services.local.tiny_model import build_tiny_model
from tests.cluster.helpers import assert_each_step_once, leader_of, no_false_loss, story
from tests.eventually import eventually
from tests.system.conftest import Stack

#: Steps of the job: enough that it trains on through the election and the
#: node timeout after it (a tiny Llama on the CPU: tens of ms a step).
STEPS = 600
#: The real trainer imports torch and transformers before its first step.
REAL_TIMEOUT_S = 180.0


@pytest.mark.slow
async def test_the_real_trainer_through_the_bucket_leaders_death(
    stack: Stack, nats_cluster: NatsCluster
) -> None:
    base = build_tiny_model("llama", stack.tmp_path / "models" / "tiny-llama")
    await stack.call(
        stack.settings.names.models_add,
        {"name": "tiny-llama", "engine": "vllm", "local_dir": str(base)},
    )
    agent = await stack.agent("node-1", trainer="real", python=sys.executable, hf_offline=True)
    params = {"max_steps": STEPS, "batch_size": 2, "max_seq_len": 32, "rank": 4, "alpha": 8}
    job = await stack.submit("node-1", model="tiny-llama", params=params)

    async def training() -> bool:
        return (await stack.get(job.id)).step >= 2

    await eventually(training, "two optimizer steps", timeout_s=REAL_TIMEOUT_S)
    victim = await leader_of(stack, kv_stream(stack.settings.names.nodes_bucket))
    await nats_cluster.kill(victim)
    await asyncio.sleep(3.0)
    # Read before the restart, which waits for the member to catch up (long
    # under load): the job must still be training when the outage ends.
    step_after = (await stack.get(job.id)).step
    await nats_cluster.restart(victim)
    done = await stack.wait_state(job.id, JobState.DONE, JobState.FAILED, timeout_s=REAL_TIMEOUT_S)
    assert done.state is JobState.DONE, f"{done.message}\n{story(*stack.schedulers, agent)}"
    assert step_after < STEPS, "the job ended before the outage was over: it proves nothing"
    no_false_loss(stack, agent)
    await assert_each_step_once(stack, job.id, STEPS)
