"""A job's dataset fetched while its NATS server is away for a moment (a
member of a rolling restart): the fetch waits for the server and completes,
instead of failing the job (tests/deploy saw a job fail at "fetching the
dataset" during the guide's rolling restart)."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

from lorafleet.nats import _bus as bus
from lorafleet.nats.server import NatsServer
from lorafleet.settings import Settings
from lorafleet_services.agent.transfer.fetch import DATA_FILE, fetch_datasets
from tests.agent.conftest import start_request

#: Seconds the server is away: past a request's timeout (5 s), within the wait (30 s).
AWAY_S = 8.0


async def test_a_fetch_waits_for_its_server_to_come_back(tmp_path: Path) -> None:
    data = b"".join(b'{"prompt": "%d", "completion": "x"}\n' % i for i in range(2000))
    sha = hashlib.sha256(data).hexdigest()
    async with NatsServer(tmp_path / "nats") as server:
        settings = Settings(nats_url=server.url)
        nc = await bus.connect(settings, "fetch-test")
        try:
            js = nc.jetstream()
            await bus.ensure_layout(js, bus.layout_for(settings))
            store = await js.object_store(settings.names.datasets_bucket)
            await store.put(f"sha256/{sha}", data)
            await server.stop()
            req = start_request("j1", f"sha256/{sha}", sha)
            fetching = asyncio.create_task(
                fetch_datasets(js, settings.names.datasets_bucket, req, tmp_path)
            )
            await asyncio.sleep(AWAY_S)
            assert not fetching.done(), fetching  # it waits, not fails
            await server.start()
            await asyncio.wait_for(fetching, 60)
        finally:
            await nc.close()
    assert (tmp_path / DATA_FILE).read_bytes() == data
