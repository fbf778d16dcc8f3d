"""A TCP relay that delays each direction: netem's `delay` where the kernel
has no sch_netem (this machine's has none).

`DelayRelay(listen_host, upstream_host, upstream_port, delay_s)` listens on
`listen_host` (the test's end of a veth pair) and forwards each connection
to the upstream server; every chunk read from one side is written to the
other `delay_s` after it was read, in order, so each direction is `delay_s`
late as with `tc netem delay` on both ends. Loss is the link's own
(`NetnsLink.drop`, nftables in the namespace), so TCP retransmits across
the delay as it would on a real degraded link. It costs one asyncio task
per direction per connection. `stop()` ends every connection; nothing else
bounds a connection's life, the test does.

Tests run it with `relay_process`, in a process of its own: in the test's
own event loop a loaded pytest worker stalled it on top of its delay (an
agent behind it once missed its 2.5 s heartbeat bound by 0.2 s at four
workers), so the link was worse than the one the test names.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

from lorafleet._process import die_with_parent

#: Bytes read at once from either side.
READ_BYTES = 64 * 1024


class DelayRelay:
    def __init__(self, listen_host: str, upstream_host: str, upstream_port: int, delay_s: float):
        self.listen_host = listen_host
        self.upstream = (upstream_host, upstream_port)
        self.delay_s = delay_s
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"nats://{self.listen_host}:{self.port}"

    async def start(self) -> DelayRelay:
        self._server = await asyncio.start_server(self._accept, self.listen_host, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task
        if self._server is not None:
            await self._server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            return
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pipe(src, dst))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        """Copy `src` to `dst`, each chunk `delay_s` after it arrived."""
        loop = asyncio.get_running_loop()
        due: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def write() -> None:
            while True:
                at, data = await due.get()
                await asyncio.sleep(max(0.0, at - loop.time()))
                if not data:
                    break
                dst.write(data)
                await dst.drain()

        writer = asyncio.create_task(write())
        try:
            while data := await src.read(READ_BYTES):
                due.put_nowait((loop.time() + self.delay_s, data))
            due.put_nowait((loop.time() + self.delay_s, b""))
            await writer
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.cancel()
            with contextlib.suppress(BaseException):
                await writer
            dst.close()


@contextlib.asynccontextmanager
async def relay_process(
    listen_host: str, upstream_host: str, upstream_port: int, delay_s: float
) -> AsyncIterator[str]:
    """A DelayRelay in a child process, for as long as the block runs: yields its URL."""
    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    argv = [sys.executable, "-m", "tests.partition.relay", listen_host, upstream_host]
    proc = await asyncio.create_subprocess_exec(
        *die_with_parent([*argv, str(upstream_port), str(delay_s)]),
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": path},
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), timeout=30)
        if not line.strip().isdigit():
            raise RuntimeError(f"the delay relay did not start (exit {await proc.wait()})")
        yield f"nats://{listen_host}:{int(line)}"
    finally:
        if proc.returncode is None:
            proc.terminate()
        await asyncio.wait_for(proc.wait(), timeout=10)


async def _serve(listen_host: str, upstream_host: str, upstream_port: int, delay_s: float) -> None:
    relay = await DelayRelay(listen_host, upstream_host, upstream_port, delay_s).start()
    print(relay.port, flush=True)
    stopped = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stopped.set)
    await stopped.wait()
    await relay.stop()


if __name__ == "__main__":
    host, upstream_host, upstream_port, delay = sys.argv[1:5]
    asyncio.run(_serve(host, upstream_host, int(upstream_port), float(delay)))
