"""Each engine's load, parsed from what it publishes: the real CPU vLLM's
/metrics (the session's server, tests/vllm_server.py), idle and with a
request streaming; llama-server's /metrics and /slots from text in the
shape its releases print (no llama-server is installed here). And the
Yielder against that vLLM: a request in flight holds the pause file."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx2
import pytest

from lorafleet import log
from lorafleet_services.agent.node.engine_load import (
    EngineLoad,
    EngineLoadError,
    LoadSource,
    LoadTarget,
    main_thread_cpu_ns,
    parse_llamacpp_metrics,
    parse_llamacpp_slots,
    parse_vllm_metrics,
    read_load,
)
from lorafleet_services.agent.training.yielding import (
    PauseFile,
    Yielder,
    YieldThresholds,
)
from tests.eventually import NeverHappenedError, eventually
from tests.vllm_server import RunningVllm

#: The first test waits for the session's vLLM to start: minutes on a busy machine.
pytestmark = pytest.mark.timeout(900)

#: Tokens a streamed request generates: a few seconds of the CPU engine.
STREAM_TOKENS = 200
#: Requests streamed one after another while a test reads the load, at most.
STREAMS = 100
#: Reads of the load while requests stream, at most.
READS = 500
#: Seconds the first completion of a vLLM just started may take.
WARM_TIMEOUT_S = 300

LLAMACPP_METRICS = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 12
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 1
"""


def test_llamacpp_metrics() -> None:
    assert parse_llamacpp_metrics("l", LLAMACPP_METRICS) == EngineLoad("l", 2, 1, tokens=12.0)


def test_llamacpp_slots_new_and_old_releases() -> None:
    new = '[{"id": 0, "is_processing": true}, {"id": 1, "is_processing": false}]'
    old = '[{"id": 0, "state": 1}, {"id": 1, "state": 1}, {"id": 2, "state": 0}]'
    assert parse_llamacpp_slots("l", new) == EngineLoad("l", 1, 0)
    assert parse_llamacpp_slots("l", old) == EngineLoad("l", 2, 0)


@pytest.mark.parametrize(
    ("parse", "text", "says"),
    [
        (parse_vllm_metrics, LLAMACPP_METRICS, "no vllm:num_requests_running"),
        (parse_llamacpp_metrics, "llamacpp:requests_processing x\n", "without a number"),
        (parse_llamacpp_slots, "<html>", "not JSON"),
        (parse_llamacpp_slots, '[{"id": 0}]', "neither is_processing nor state"),
    ],
)
def test_what_an_engine_does_not_publish_is_refused(parse: object, text: str, says: str) -> None:
    with pytest.raises(EngineLoadError, match=says):
        parse("e", text)  # type: ignore[operator]


#: A server as the yielder reads it from /proc: its main thread spins while
#: the file named by argv[1] exists, else sleeps in 5 ms polls (a server at rest).
SERVER = """
import os, sys, time
while True:
    if os.path.exists(sys.argv[1]):
        end = time.monotonic() + 0.05
        while time.monotonic() < end:
            pass
    else:
        time.sleep(0.005)
"""


@contextlib.contextmanager
def server_process(switch: Path) -> Iterator[int]:
    with subprocess.Popen([sys.executable, "-c", SERVER, str(switch)]) as proc:
        try:
            yield proc.pid
        finally:
            proc.kill()


def test_a_processs_main_thread_run_time_is_read_from_proc(tmp_path: Path) -> None:
    switch = tmp_path / "work"
    with server_process(switch) as pid:

        def ran_ns_in(seconds: float) -> int:
            t0 = main_thread_cpu_ns(pid)
            time.sleep(seconds)
            t1 = main_thread_cpu_ns(pid)
            assert t0 is not None and t1 is not None
            return t1 - t0

        assert ran_ns_in(0.2) < 0.2e8  # at rest: its polls, well under a tenth of a core
        switch.touch()
        assert ran_ns_in(0.2) > 0.5e8  # working: over a quarter of a core
    assert main_thread_cpu_ns(pid) is None  # gone


async def test_the_yielder_pauses_for_a_server_it_sees_working(tmp_path: Path) -> None:
    """From /proc alone (its /metrics refused: nothing there): the pause is held
    while the server works and let go once it rests."""
    switch, pause = tmp_path / "work", PauseFile(tmp_path / "pause")
    with server_process(switch) as pid:
        target = LoadTarget("http://127.0.0.1:9", LoadSource.VLLM_METRICS, pid=pid)
        yielder = Yielder(pause, lambda: [target], YieldThresholds(), log.get())
        task = asyncio.create_task(yielder.run())
        try:
            await asyncio.sleep(0.5)
            assert not pause.path.exists(), yielder.state
            switch.touch()
            await eventually(pause.path.exists, "the pause file, the server working")
            assert "server is working" in pause.path.read_text()
            switch.unlink()
            await eventually(lambda: not pause.path.exists(), "the pause let go, at rest")
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def test_a_pause_just_held_reads_metrics_at_its_next_tick(tmp_path: Path) -> None:
    """The ticks that read /proc alone do not count as /metrics reads: once the
    server is seen working, the next tick reads its /metrics (to hold the
    pause through a quiet stretch), not a sample_s after the last empty tick."""
    reads: list[float] = []

    async def count(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        reads.append(now[0])
        writer.close()  # no answer: read_load takes it as down, which is all this needs

    server = await asyncio.start_server(count, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    switch, pause, now = tmp_path / "work", PauseFile(tmp_path / "pause"), [0.0]
    th = YieldThresholds()
    try:
        with server_process(switch) as pid:
            target = LoadTarget(f"http://127.0.0.1:{port}", LoadSource.VLLM_METRICS, pid=pid)
            yielder = Yielder(pause, lambda: [target], th, log.get(), clock=lambda: now[0])
            async with httpx2.AsyncClient() as http:
                await yielder.sample(http)  # at rest: /proc alone
                switch.touch()
                await asyncio.sleep(0.2)  # it spins: well over a tenth of a core
                now[0] = th.sample_s / 2
                await yielder.sample(http)  # seen working: the pause is held
                assert pause.path.exists() and reads == [], (yielder.state, reads)
                now[0] += th.cpu_sample_s
                await yielder.sample(http)
        assert reads == [now[0]], f"/metrics read at {reads}, the pause held at {th.sample_s / 2}"
    finally:
        server.close()
        await server.wait_closed()


async def test_unreachable_engine_reads_none() -> None:
    async with httpx2.AsyncClient() as http:
        # Port 9 (discard) on loopback: nothing listens in the test machine.
        target = LoadTarget("http://127.0.0.1:9", LoadSource.VLLM_METRICS)
        assert await read_load(http, target) is None


async def test_an_engine_that_takes_the_read_but_does_not_answer_reads_late() -> None:
    """A server on loopback that accepts and never answers: late (taken as
    busy), not None (taken as down)."""
    accepted: list[asyncio.StreamWriter] = []

    async def hold(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with httpx2.AsyncClient() as http:
            target = LoadTarget(f"http://127.0.0.1:{port}", LoadSource.VLLM_METRICS)
            assert await read_load(http, target) == EngineLoad(target.url, 0, 0, late=True)
    finally:
        for writer in accepted:
            writer.close()
        server.close()
        await server.wait_closed()
    assert accepted


async def warmed(server: RunningVllm) -> None:
    """One short completion, answered: a vLLM just started compiles its kernels
    on its first request, which on a loaded machine takes tens of seconds, and
    until its engine sends outputs the server's gauges stay at zero (a CI run
    read zeros for 52 s while its requests were in flight)."""
    body = {"model": str(server.model_dir), "prompt": "Hello", "max_tokens": 2}
    async with httpx2.AsyncClient(timeout=WARM_TIMEOUT_S) as http:
        r = await http.post(f"{server.url}/v1/completions", json=body)
    assert r.status_code == 200, r.text


@contextlib.asynccontextmanager
async def streaming(server: RunningVllm) -> AsyncIterator[asyncio.Task[int]]:
    """Streamed completions of STREAM_TOKENS in flight, one after another, until the
    block ends (at most STREAMS of them): one request on the tiny model can end
    between two reads of /metrics, which a busy server answers late. The task answers
    the chunks seen."""

    async def go() -> int:
        body = {
            "model": str(server.model_dir), "prompt": "Hello", "stream": True,
            "max_tokens": STREAM_TOKENS, "ignore_eos": True,
        }  # fmt: skip
        chunks = 0
        async with httpx2.AsyncClient(timeout=120) as http:
            for _ in range(STREAMS):
                async with http.stream("POST", f"{server.url}/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        chunks += line.startswith("data: {")
        return chunks

    task = asyncio.create_task(go())
    try:
        yield task
    finally:
        if not task.done():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def busy_since(load: EngineLoad | None, idle: EngineLoad) -> bool:
    """A request running, or tokens processed since `idle` was read."""
    if load is None:
        return False
    grew = load.tokens is not None and idle.tokens is not None and load.tokens > idle.tokens
    return load.running >= 1 or grew


async def _loads_until_busy(
    http: httpx2.AsyncClient, t: LoadTarget, task: asyncio.Task[int], idle: EngineLoad
) -> list[EngineLoad | None]:
    """Reads of the load while requests stream, up to the first that shows work."""
    seen: list[EngineLoad | None] = []
    for _ in range(READS):
        if task.done():
            break
        seen.append(load := await read_load(http, t))
        if busy_since(load, idle):
            break
        await asyncio.sleep(0.02)
    return seen


def is_idle(load: EngineLoad | None) -> bool:
    return load is not None and (load.running, load.waiting, load.late) == (0, 0, False)


async def test_vllm_idle_then_busy_then_idle(vllm_server: RunningVllm) -> None:
    """Busy is a request running or its tokens counted: on a starved machine the
    CPU vLLM's API server takes a request's outputs in one burst, and its
    running gauge read 0 at every read while requests streamed (a CI run)."""
    target = LoadTarget(vllm_server.url, LoadSource.VLLM_METRICS)
    await warmed(vllm_server)
    async with httpx2.AsyncClient() as http:
        idle = await read_load(http, target)
        assert idle is not None and is_idle(idle) and idle.tokens is not None, idle
        async with streaming(vllm_server) as task:
            seen = await _loads_until_busy(http, target, task, idle)
        assert any(busy_since(x, idle) for x in seen), seen
        await eventually(lambda: read_load(http, target), "vLLM idle again", until=is_idle)


@pytest.mark.parametrize("seen", [False, True], ids=["metrics", "proc"])
async def test_the_yielder_holds_the_pause_while_vllm_streams(
    vllm_server: RunningVllm, tmp_path: Path, seen: bool
) -> None:
    """Read through /metrics (an engine the agent cannot see), or from /proc
    with /metrics while paused: held while requests stream, let go once the
    engine is idle (the reads' own cost to its server, ~1 ms of its main
    thread each, is not counted as its users' work)."""
    target = LoadTarget(
        vllm_server.url, LoadSource.VLLM_METRICS, pid=vllm_server.pid if seen else None
    )
    await warmed(vllm_server)
    pause = PauseFile(tmp_path / "pause")
    th = YieldThresholds(sample_s=0.05, idle_s=0.2, run_share=0.0)
    yielder = Yielder(pause, lambda: [target], th, log.get())
    task = asyncio.create_task(yielder.run())
    try:
        async with streaming(vllm_server):
            try:
                await eventually(pause.path.exists, "the pause file, a request streaming")
            except NeverHappenedError as e:
                raise NeverHappenedError(f"{e}; the yielder's last state: {yielder.state}") from e
            assert vllm_server.url in pause.path.read_text()
        await eventually(lambda: not pause.path.exists(), "the pause let go, the engine idle")
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert not pause.path.exists()
