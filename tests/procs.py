"""Running lorafleet services as real processes in tests (so they can be SIGKILLed)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

from lorafleet.settings import Settings

#: Seconds a service has to log `service.started`.
START_TIMEOUT_S = 60.0


class ServiceProcess:
    """`python -m <module> [args]` with the settings in its environment.

    The process logs JSON lines on stderr; `lines` keeps them all (decoded).
    `start()` returns once it has logged `service.started`.
    """

    def __init__(
        self,
        module: str,
        settings: Settings,
        args: list[str] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.module = module
        self.settings = settings
        self.args = args or []
        self.env = dict(env or {})
        self.proc: asyncio.subprocess.Process | None = None
        self.lines: list[dict[str, Any]] = []
        self.raw: list[str] = []
        self._reader: asyncio.Task[None] | None = None
        self._started = asyncio.Event()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    async def start(self, timeout_s: float = START_TIMEOUT_S) -> ServiceProcess:
        env = {**os.environ, **self.settings.to_env(), **self.env, "PYTHONUNBUFFERED": "1"}
        self._started = asyncio.Event()
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", self.module, *self.args,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
            start_new_session=True,
        )  # fmt: skip
        self._reader = asyncio.create_task(self._read())
        try:
            await asyncio.wait_for(self._started.wait(), timeout_s)
        except TimeoutError:
            await self.stop()
            raise AssertionError(
                f"{self.module} did not start:\n" + "".join(self.raw[-30:])
            ) from None
        return self

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        while line := await self.proc.stderr.readline():
            text = line.decode(errors="replace")
            self.raw.append(text)
            with contextlib.suppress(ValueError):
                obj = json.loads(text)
                if isinstance(obj, dict):
                    self.lines.append(obj)
                    if obj.get("event") == "service.started":
                        self._started.set()

    def events(self, name: str) -> list[dict[str, Any]]:
        return [ln for ln in self.lines if ln.get("event") == name]

    async def wait_for_event(self, name: str, timeout_s: float = 30.0) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            found = self.events(name)
            if found:
                return found[-1]
            await asyncio.sleep(0.05)
        raise AssertionError(f"{self.module} never logged {name}:\n" + "".join(self.raw[-30:]))

    def kill(self) -> None:
        """SIGKILL the whole process group at once."""
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    async def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM, wait, then SIGKILL; return the exit code."""
        proc = self.proc
        if proc is None:
            return None
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), timeout_s)
            except TimeoutError:
                self.kill()
                await proc.wait()
        if self._reader is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._reader, 5)
        return proc.returncode

    async def __aenter__(self) -> ServiceProcess:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
