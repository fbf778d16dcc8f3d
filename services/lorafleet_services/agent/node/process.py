"""Subprocess lifecycle, written once: start in its own session (as another
user when asked), relay stdout lines, keep the tail of stderr, stop the whole
process group (SIGTERM, then SIGKILL after a grace), and leave nothing behind.

torch and the tokenizers start workers of their own; killing only the
trainer's pid would leave them holding card memory, so every signal goes to
the process group.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from lorafleet_services.agent.config import EngineUser

#: Longest stdout line relayed; a longer one is a protocol error.
MAX_LINE_BYTES = 1 << 20
#: Bytes of stderr kept for the failure message.
STDERR_TAIL_BYTES = 16 << 10

LineHandler = Callable[[bytes], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class ProcessResult:
    returncode: int
    #: The last lines of stderr, joined with " | " (the reason a process failed
    #: is at the end; the rest is progress bars).
    stderr_tail: str
    #: True when stop() ended it.
    stopped: bool


class ManagedProcess:
    """One child process in its own session. Use `start()`, then `wait()`;
    `stop()` from anywhere ends it and its whole group."""

    def __init__(self) -> None:
        self.proc: asyncio.subprocess.Process | None = None
        self._stderr: deque[bytes] = deque()
        self._stderr_len = 0
        self._stopped = False
        self._tasks: list[asyncio.Task[None]] = []

    def _started(self) -> asyncio.subprocess.Process:
        if self.proc is None:
            raise RuntimeError("ManagedProcess.start() first")
        return self.proc

    @property
    def pid(self) -> int:
        return self._started().pid

    async def start(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: str | Path,
        user: EngineUser | None = None,
        on_line: LineHandler | None = None,
    ) -> ManagedProcess:
        kwargs: dict[str, object] = {}
        if user is not None:
            kwargs.update(user=user.uid, group=user.gid, extra_groups=list(user.groups))
        self.proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=dict(env),
            cwd=str(cwd),
            start_new_session=True,
            limit=MAX_LINE_BYTES,
            **kwargs,  # type: ignore[arg-type]
        )
        self._tasks = [
            asyncio.create_task(self._relay(on_line)),
            asyncio.create_task(self._keep_stderr()),
        ]
        return self

    async def _relay(self, on_line: LineHandler | None) -> None:
        stdout = self._started().stdout
        if stdout is None:
            raise RuntimeError("the process was started without a stdout pipe")
        while True:
            try:
                line = await stdout.readline()
            except ValueError:  # a line longer than MAX_LINE_BYTES
                self._note_stderr(b"[lorafleet] a stdout line over 1 MiB was dropped\n")
                continue
            if not line:
                return
            if on_line is not None:
                await on_line(line.rstrip(b"\r\n"))

    def _note_stderr(self, chunk: bytes) -> None:
        self._stderr.append(chunk)
        self._stderr_len += len(chunk)
        while self._stderr_len > STDERR_TAIL_BYTES and len(self._stderr) > 1:
            self._stderr_len -= len(self._stderr.popleft())

    async def _keep_stderr(self) -> None:
        stderr = self._started().stderr
        if stderr is None:
            raise RuntimeError("the process was started without a stderr pipe")
        while chunk := await stderr.read(4096):
            self._note_stderr(chunk)

    def stderr_tail(self, lines: int = 3) -> str:
        text = b"".join(self._stderr).decode(errors="replace").strip()
        return " | ".join(text.splitlines()[-lines:])

    def _signal_group(self, sig: signal.Signals) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    async def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM the group, SIGKILL it after `grace_s` seconds if it is still there."""
        if self.proc is None:
            return
        self._stopped = True
        self._signal_group(signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self.proc.wait()), grace_s)
        self._signal_group(signal.SIGKILL)

    async def wait(self) -> ProcessResult:
        rc = await self._started().wait()
        # The leader is gone; whatever it started in its session goes too.
        self._signal_group(signal.SIGKILL)
        for t in self._tasks:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(t, 5)
        return ProcessResult(returncode=rc, stderr_tail=self.stderr_tail(), stopped=self._stopped)


async def run_process(
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: str | Path,
    user: EngineUser | None = None,
    on_line: LineHandler | None = None,
    cancel: asyncio.Event | None = None,
    grace_s: float = 5.0,
) -> ProcessResult:
    """Run `argv` to its end; setting `cancel` stops its whole process group."""
    mp = await ManagedProcess().start(argv, env=env, cwd=cwd, user=user, on_line=on_line)
    waiter = asyncio.create_task(mp.wait())
    canceller: asyncio.Task[bool] | None = None
    try:
        if cancel is not None:
            canceller = asyncio.create_task(cancel.wait())
            done, _ = await asyncio.wait({waiter, canceller}, return_when=asyncio.FIRST_COMPLETED)
            if canceller in done and not waiter.done():
                await mp.stop(grace_s)
        return await waiter
    except asyncio.CancelledError:
        await mp.stop(grace_s)
        raise
    finally:
        if canceller is not None:
            canceller.cancel()
