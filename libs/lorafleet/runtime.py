"""How a lorafleet process runs: settings from the environment, JSON logs,
SIGTERM/SIGINT for a clean stop. Each service module ends with

    if __name__ == "__main__":
        runtime.main("recorder", run)

where `run(settings, stop)` starts the service, logs `service.started` once
it answers requests, and returns after `stop` is set.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable

from lorafleet import log
from lorafleet.settings import Settings

ServiceRun = Callable[[Settings, asyncio.Event], Awaitable[None]]


async def run_until_signal(run: ServiceRun, settings: Settings) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await run(settings, stop)


def main(service: str, run: ServiceRun, settings: Settings | None = None) -> None:
    settings = settings or Settings.from_env()
    log.configure(service, settings.log_level)
    asyncio.run(run_until_signal(run, settings))
