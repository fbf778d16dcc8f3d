"""The gateway on its own nkey identity (`lorafleet auth`'s service/gateway):
a client's rights and its KV bucket are all its work needs, on a server
that denies everything else."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from lorafleet.client import Client
from lorafleet_schemas.messages import Engine, ModelSpec
from lorafleet_services.gateway.api_keys import make_key
from tests.gateway.conftest import sdk_for
from tests.permissions.conftest import start_identity_fleet
from tests.procs import ServiceProcess

DATA = b'{"q": "what is 1+1?", "a": "2"}\n' * 4


async def test_the_gateway_works_on_its_own_identity_alone(tmp_path: Path) -> None:
    fleet = await start_identity_fleet(tmp_path)
    # This machine is shared: a slow moment must not read as a 503.
    fleet.base = fleet.base.with_(request_timeout_s=10.0)
    keys_file = tmp_path / "keys.json"
    key = make_key(keys_file, "alice")
    recorder = ServiceProcess(
        "lorafleet_services.recorder", fleet.settings_for("service", "recorder")
    )
    env = {"LORAFLEET_GATEWAY_ADDR": "127.0.0.1:0",
           "LORAFLEET_GATEWAY_API_KEYS_FILE": str(keys_file)}  # fmt: skip
    gateway = ServiceProcess(
        "lorafleet_services.gateway", fleet.settings_for("service", "gateway"), env=env
    )
    try:
        await recorder.start()
        await gateway.start()
        async with await Client.connect(fleet.settings_for("client", "cli")) as lf:
            spec = ModelSpec(name="tiny", engine=Engine.VLLM, local_dir=str(tmp_path))
            await lf.add_model(spec, read_architecture=False)
        url = (await gateway.wait_for_event("gateway.listening"))["url"]
        async with sdk_for(url, key) as sdk:
            # A refused upload's chunks are purged: a right of the gateway's own.
            with pytest.raises(openai.BadRequestError, match="line 5"):
                await sdk.files.create(file=("b.jsonl", DATA + b"[]\n"), purpose="fine-tune")
            uploaded = await sdk.files.create(file=("a.jsonl", DATA), purpose="fine-tune")
            assert [f.id async for f in sdk.files.list()] == [uploaded.id]
            assert (await sdk.files.content(uploaded.id)).content == DATA
            job = await sdk.fine_tuning.jobs.create(
                model="tiny", training_file=uploaded.id,
                extra_body={"lorafleet": {"gpu_memory_mib": 100}},
            )  # fmt: skip
            assert (await sdk.fine_tuning.jobs.retrieve(job.id)).status == "queued"
            assert [j.id async for j in sdk.fine_tuning.jobs.list()] == [job.id]
            await sdk.files.delete(uploaded.id)
        assert fleet.server_refusals() == [], gateway.tail()
    finally:
        await gateway.stop()
        await recorder.stop()
        await fleet.server.stop()
