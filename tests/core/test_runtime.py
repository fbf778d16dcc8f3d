"""One service lifecycle (lorafleet._runtime): exit codes of a real process, serve() in-process."""

from __future__ import annotations

import asyncio
import io
import json
import os
import sys
from pathlib import Path

import nats.errors
import nats.js.errors
import pytest
import structlog
from nats.aio.client import Client

from lorafleet import _runtime as runtime
from lorafleet import log
from lorafleet.exits import Exit
from lorafleet.nats import _bus as bus
from lorafleet.nats.server import NatsServer
from lorafleet.settings import Settings
from tests.eventually import eventually

#: Seconds a service process may take to give up.
EXIT_TIMEOUT_S = 60.0


async def run_module(module: str, env: dict[str, str]) -> tuple[int, list[str]]:
    """Run `python -m module` with `env` over ours; its exit code and stderr lines."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", module,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **env},
    )  # fmt: skip
    _, err = await asyncio.wait_for(proc.communicate(), EXIT_TIMEOUT_S)
    assert proc.returncode is not None
    return proc.returncode, err.decode().splitlines()


async def test_a_bad_setting_exits_2_with_one_line(tmp_path: Path) -> None:
    code, lines = await run_module(
        "lorafleet_services.recorder",
        {"LORAFLEET_NODE_TIMEOUT_S": "soon", "LORAFLEET_DATA_DIR": str(tmp_path)},
    )
    assert code == 2
    assert len(lines) == 1, lines
    assert lines[0].startswith("lorafleet recorder: LORAFLEET_NODE_TIMEOUT_S='soon'"), lines


async def test_no_nats_server_exits_unreachable_with_one_line(tmp_path: Path) -> None:
    code, lines = await run_module(
        "lorafleet_services.recorder",
        {
            "LORAFLEET_NATS_URL": "nats://127.0.0.1:1",
            "LORAFLEET_CONNECT_TIMEOUT_S": "1",
            "LORAFLEET_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path / 'r.db'}",
        },
    )
    assert code == Exit.UNREACHABLE
    # JSON log lines (service.stopped) and exactly one plain line, the error.
    plain = [ln for ln in lines if not ln.startswith("{")]
    assert len(plain) == 1, lines
    assert plain[0].startswith("lorafleet recorder: no NATS server answered"), lines
    assert "LORAFLEET_NATS_URL" in plain[0]


class Toy:
    """A service that records its life."""

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.calls: list[str] = []

    async def start(self) -> None:
        self.calls.append("start")

    async def stop(self) -> None:
        self.calls.append("stop")


async def test_serve_starts_stops_and_logs(settings: Settings) -> None:
    made: list[Toy] = []

    async def make(nc: Client, _settings: Settings) -> Toy:
        made.append(Toy(nc))
        return made[0]

    before: list[Settings] = []

    async def before_connect(s: Settings) -> None:
        before.append(s)

    out = io.StringIO()
    log.configure("toy", stream=out)
    program = runtime.Program(
        "toy", make, before_connect=before_connect, started_fields={"colour": "blue"}
    )
    stop = asyncio.Event()
    task = asyncio.create_task(runtime.serve(program, settings, stop))
    try:
        await eventually(
            lambda: '"service.started"' in out.getvalue(), "service.started", timeout_s=10
        )
        assert before == [settings] and made[0].calls == ["start"]
        assert made[0].nc.is_connected
        stop.set()
        await asyncio.wait_for(task, 10)
    finally:
        stop.set()
        structlog.reset_defaults()
        structlog.contextvars.clear_contextvars()
    assert made[0].calls == ["start", "stop"] and made[0].nc.is_closed
    events = [json.loads(ln) for ln in out.getvalue().splitlines()]
    started = next(e for e in events if e["event"] == "service.started")
    assert started["colour"] == "blue" and started["service"] == "toy" and "version" in started
    assert events[-1]["event"] == "service.stopped"


@pytest.mark.parametrize("layout", ["ensure", "if_allowed"])
async def test_serve_ensures_the_layout(settings: Settings, layout: str) -> None:
    async def make(nc: Client, _settings: Settings) -> Toy:
        streams = await nc.jetstream().streams_info()
        assert {s.config.name for s in streams} >= {settings.names.status_stream}
        return Toy(nc)

    stop = asyncio.Event()
    stop.set()  # start, then stop at once
    program = runtime.Program("toy", make, layout=layout)  # type: ignore[arg-type]
    await asyncio.wait_for(runtime.serve(program, settings, stop), 20)


class Rejoining(Toy):
    def __init__(self, nc: Client) -> None:
        super().__init__(nc)
        self.rejoined = 0

    def reconnected(self) -> None:
        self.rejoined += 1


async def test_serve_tells_the_service_of_a_reconnect(
    settings: Settings, nats_server: NatsServer
) -> None:
    made: list[Rejoining] = []

    async def make(nc: Client, _settings: Settings) -> Rejoining:
        made.append(Rejoining(nc))
        return made[0]

    stop = asyncio.Event()
    task = asyncio.create_task(runtime.serve(runtime.Program("toy", make), settings, stop))
    try:
        await eventually(lambda: made and made[0].calls == ["start"], "the service started")
        await nats_server.restart()
        await eventually(lambda: made[0].rejoined, "reconnected() called", timeout_s=15)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
    assert made[0].calls == ["start", "stop"] and made[0].rejoined == 1


def test_the_layout_is_tried_again_while_a_member_is_missing() -> None:
    """ "no suitable peers for placement" (a just-ready cluster, a member not
    yet connected) is tried again, never taken for a stream that exists and
    updated (which answered "stream not found" in a parallel CI run)."""
    missing = nats.js.errors.BadRequestError(code=400, err_code=10005, description="no peers")
    exists = nats.js.errors.BadRequestError(code=400, err_code=10058, description="in use")
    assert bus.placement_pending(missing)
    assert not bus.placement_pending(exists)
    assert not bus.placement_pending(nats.errors.TimeoutError())
    assert bus.cluster_pending(nats.errors.TimeoutError())
    assert bus.cluster_pending(missing) and not bus.cluster_pending(exists)
