"""A ServingAgent in this process, beside a stand-in engine it can restart:
what tests/agent/test_serving_reload.py and the serving benches
(bench/serving_reload.py, bench/serving_restart.py) share."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

from nats.js import JetStreamContext

from lorafleet._tasks import stop_tasks
from lorafleet.artifacts import file_sha256
from lorafleet.names import Names
from lorafleet_services.agent.config import AgentConfig
from lorafleet_services.agent.serving.agent import ServingAgent
from lorafleet_trainer.layout import ADAPTER_WEIGHTS
from lorafleet_trainer.standin import adapter_files
from tests.gateway.engine import engine_argv

#: Seconds the serving agent's loads and reports get to end when it stops.
STOP_TIMEOUT_S = 5.0


@contextlib.asynccontextmanager
async def running_serving_agent(
    js: JetStreamContext, names: Names, cfg: AgentConfig
) -> AsyncIterator[ServingAgent]:
    """A ServingAgent started (its engine watch, loads and reports), stopped
    as the node agent stops it when the block ends."""
    agent = ServingAgent(js, names, cfg)
    stop = asyncio.Event()
    tasks = agent.start(stop)
    try:
        yield agent
    finally:
        stop.set()
        await agent.stop(STOP_TIMEOUT_S)
        await stop_tasks(*tasks)


class StandinEngine:
    """The engine process on a fixed port, started again at will."""

    def __init__(self, base: Path, port: int, control: Path, max_loras: int = 12) -> None:
        self.base, self.port, self.control, self.max_loras = base, port, control, max_loras
        self.url = f"http://127.0.0.1:{port}"
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        env = {**os.environ, "LORAFLEET_STANDIN_ENGINE_CONTROL": str(self.control),
               "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}  # fmt: skip
        self.proc = await asyncio.create_subprocess_exec(
            *engine_argv(str(self.base), self.port, max_loras=self.max_loras), env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), 30)
        assert line.startswith(b"listening"), line

    async def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()


def staged_adapter(root: Path, job_id: str) -> tuple[Path, str]:
    """The stand-in trainer's adapter for `job_id`, as the agent stages it."""
    path = root / job_id
    path.mkdir(parents=True)
    for name, data in adapter_files(job_id).items():
        (path / name).write_bytes(data)
    return path, file_sha256(path / ADAPTER_WEIGHTS)
