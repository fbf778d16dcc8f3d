"""The gateway's tests: the official openai SDK, unmodified, against a real
gateway process on a real stack (nats-server, PostgreSQL, recorder,
scheduler, artifact-store, an agent with the stand-in trainer) and a real
engine process (tests/gateway/engine.py). One stack per test module: the
fixtures are module-scoped, and so is the event loop of the module's tests."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio
from openai import AsyncOpenAI

from lorafleet.nats.server import NatsServer
from lorafleet_services.gateway.api_keys import make_key
from tests.pg import throwaway_database
from tests.procs import ServiceProcess
from tests.system.conftest import Stack, running_stack, system_settings

#: Seconds the engine process has to say where it listens.
ENGINE_START_TIMEOUT_S = 20.0


@dataclass
class Engine:
    """The engine process and its OpenAI base URL (`.../v1`)."""

    proc: asyncio.subprocess.Process
    base_url: str


@dataclass
class Gateway:
    stack: Stack
    engine: Engine
    proc: ServiceProcess
    url: str
    keys: dict[str, str]
    #: The keys file the gateway reads (a test adds and revokes keys in it).
    keys_file: Path

    def sdk(self, client: str = "alice") -> AsyncOpenAI:
        """The SDK for `client`'s key (a name without a key is sent as the key)."""
        return sdk_for(self.url, self.keys.get(client, client))


def sdk_for(url: str, key: str) -> AsyncOpenAI:
    """The SDK as a user makes it: base_url and api_key; no retries, so that
    each error shows as the SDK raises it."""
    return AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


@contextlib.asynccontextmanager
async def engine_process() -> AsyncIterator[Engine]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.gateway.engine", stdout=asyncio.subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), ENGINE_START_TIMEOUT_S)
        url = line.decode().split()[-1]
        yield Engine(proc, f"{url}/v1")
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        await proc.wait()


@pytest.fixture(scope="module")
def module_pg(pg_template: str) -> Iterator[str]:
    with throwaway_database(template=pg_template) as url:
        yield url


@pytest.fixture(scope="module")
def gateway_env() -> dict[str, str]:
    """More LORAFLEET_GATEWAY_* for the module's gateway (a module overrides this)."""
    return {}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway(
    module_pg: str, tmp_path_factory: pytest.TempPathFactory, gateway_env: dict[str, str]
) -> AsyncIterator[Gateway]:
    tmp = tmp_path_factory.mktemp("gateway")
    nats = NatsServer(tmp / "nats-store")
    await nats.start()
    keys_file = tmp / "keys.json"
    keys = {name: make_key(keys_file, name) for name in ("alice", "bob")}
    settings = system_settings(nats.url, module_pg, tmp)
    try:
        async with (
            running_stack(settings, nats, tmp, "gateway-test") as stack,
            engine_process() as engine,
        ):
            await stack.add_model("tiny")
            await stack.agent("node-1")
            env = {"LORAFLEET_GATEWAY_ENGINES": engine.base_url, **gateway_env}
            async with gateway_on(stack, keys_file, env) as (proc, url):
                yield Gateway(stack, engine, proc, url, keys, keys_file)
    finally:
        await nats.stop()


@contextlib.asynccontextmanager
async def gateway_on(
    stack: Stack, keys_file: Path, more: dict[str, str]
) -> AsyncIterator[tuple[ServiceProcess, str]]:
    """A gateway process on `stack` and its URL; without LORAFLEET_GATEWAY_ENGINES
    in `more` it routes by the serving records alone."""
    env = {
        "LORAFLEET_GATEWAY_ADDR": "127.0.0.1:0",
        "LORAFLEET_GATEWAY_API_KEYS_FILE": str(keys_file),
        "LORAFLEET_GATEWAY_ENGINE_MODELS_TTL_S": "0.5",
        **more,
    }
    proc = ServiceProcess("lorafleet_services.gateway", stack.settings, env=env)
    stack.procs.append(proc)
    await proc.start()
    url = (await proc.wait_for_event("gateway.listening"))["url"]
    try:
        yield proc, url
    finally:
        print("gateway's last lines:\n" + proc.tail(20))
