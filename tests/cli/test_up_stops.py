"""`lorafleet up` leaves nothing running once it is gone: its terminal
closed (SIGHUP) stops it cleanly, and killed outright (SIGKILL) its
children get a parent-death SIGTERM and stop too — found when a killed
`up` left five processes holding its ports, and the next `up` could not
start."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from lorafleet.settings import Settings
from lorafleet_services.gateway.service import CHECK_WORKERS
from lorafleet_services.stack import ServiceProcess
from tests.cli.conftest import ROOT, UP_TIMEOUT_S, cli_argv, up_env
from tests.eventually import eventually

#: nats-server, recorder, scheduler, artifact-store, gateway, agent; and the
#: gateway's upload check workers with multiprocessing's resource tracker.
CHILDREN = 6 + CHECK_WORKERS + 1
#: Seconds the children have to stop once `up` is gone (each drains on SIGTERM).
GONE_TIMEOUT_S = 30.0


@dataclass
class RunningUp:
    proc: asyncio.subprocess.Process
    children: list[psutil.Process]
    data_dir: Path


@pytest.fixture
async def running_up(tmp_path: Path) -> AsyncIterator[RunningUp]:
    proc = await asyncio.create_subprocess_exec(
        *cli_argv("up", "--nats-port", "0"),  # the server takes a free port
        cwd=ROOT, env=up_env(tmp_path), stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stderr is not None
    said: list[str] = []
    ready = asyncio.Event()

    async def read(stderr: asyncio.StreamReader) -> None:
        # Read to the end: `up` writes every child's log lines here.
        while line := await stderr.readline():
            said.append(line.decode(errors="replace"))
            if "lorafleet is up" in said[-1]:
                ready.set()

    reader = asyncio.create_task(read(proc.stderr))
    procs = [psutil.Process(proc.pid)]
    try:
        await eventually(ready.is_set, "lorafleet is up", timeout_s=UP_TIMEOUT_S)
        children = procs[0].children(recursive=True)
        procs += children
        assert len(children) == CHILDREN, [c.cmdline()[:3] for c in children]
        yield RunningUp(proc, children, tmp_path / "data")
    finally:
        for p in procs:
            if p.is_running():
                p.kill()
        await proc.wait()
        await reader


def _alive(procs: list[psutil.Process]) -> list[str]:
    alive = []
    for p in procs:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                alive.append(" ".join(p.cmdline()[:4]))
        except psutil.NoSuchProcess:
            pass
    return alive


async def test_a_closed_terminal_stops_up_cleanly(running_up: RunningUp) -> None:
    running_up.proc.send_signal(signal.SIGHUP)
    rc = await asyncio.wait_for(running_up.proc.wait(), GONE_TIMEOUT_S)
    assert rc == 0
    # `up` removes its nats-url file last, once every child has stopped.
    assert not (running_up.data_dir / "nats-url").exists()
    assert _alive(running_up.children) == []


async def test_up_killed_outright_leaves_no_child_running(running_up: RunningUp) -> None:
    running_up.proc.kill()
    await running_up.proc.wait()
    await eventually(
        lambda: _alive(running_up.children), "every child of the killed up to stop",
        until=lambda alive: alive == [], timeout_s=GONE_TIMEOUT_S,
    )  # fmt: skip


class _Forking(ServiceProcess):
    """A child that starts a grandchild holding its stderr, then says it started."""

    def command(self) -> list[str]:
        script = (
            "import json, subprocess, sys, time\n"
            "g = subprocess.Popen(['sleep', '300'])\n"
            "print(json.dumps({'event': 'service.started', 'grandchild': g.pid}), "
            "file=sys.stderr, flush=True)\n"
            "time.sleep(300)\n"
        )
        return [sys.executable, "-c", script]


async def test_a_killed_service_takes_what_it_started_with_it() -> None:
    """A service SIGKILLed alone (the nemesis's gateway kill, the OOM killer)
    leaves what it started (the gateway's check workers) holding its stderr:
    stopping it ends them too, so its log reader reaches the end."""
    proc = await _Forking("forking", Settings()).start()
    grandchild = psutil.Process(proc.events("service.started")[0]["grandchild"])
    assert proc.proc is not None
    os.kill(proc.proc.pid, signal.SIGKILL)  # the service alone, not its group
    await proc.stop(timeout_s=5)
    _, alive = await asyncio.to_thread(psutil.wait_procs, [grandchild], timeout=10)
    assert all(p.status() == psutil.STATUS_ZOMBIE for p in alive), alive
    assert proc._reader is not None and proc._reader.done()
