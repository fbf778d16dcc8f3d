"""The engines running on this node, re-read every `engines_refresh_s`.

One read is the process scan (a walk of /proc in a thread) and each
server's `/v1/models`, each call bounded by `MODELS_TIMEOUT_S`: tens of
milliseconds on a quiet node, seconds on a busy engine, so the heartbeat
never waits for one but takes the last (`refs()`). A process that does not
answer keeps, in the heartbeat, what it listed last (`answered` false): a
busy engine listed empty had the placement ask for every adapter it holds.
After each read `on_read(views, previous)` lets the serving agent load
again what an engine lost.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from lorafleet import log
from lorafleet.log import Event
from lorafleet_schemas.messages import Engine, EngineRef
from lorafleet_services.agent.serving.running_engines import VllmServer, running_vllm_servers
from lorafleet_services.agent.serving.vllm_adapters import loaded_adapters
from lorafleet_services.agent.serving.vllm_client import VllmClient, VllmError

#: Seconds one engine's /v1/models may take in a refresh.
MODELS_TIMEOUT_S = 5.0
#: Seconds the process scan may take.
SCAN_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class EngineView:
    """One engine as the last read saw it. adapters: what /v1/models listed;
    None when it did not answer (starting, stopped, hung)."""

    server: VllmServer
    adapters: tuple[str, ...] | None
    #: While it does not answer: what the same process listed last.
    last_listed: tuple[str, ...] = ()

    @property
    def up(self) -> bool:
        return self.adapters is not None

    def after(self, before: EngineView | None) -> EngineView:
        """This read, keeping `before`'s list when this one went unanswered
        and the process is the same (a new one lost what the old held)."""
        if self.up or before is None or before.server.pid != self.server.pid:
            return self
        kept = before.adapters if before.adapters is not None else before.last_listed
        return EngineView(self.server, None, kept)

    def ref(self) -> EngineRef:
        s = self.server
        return EngineRef(
            kind=Engine.VLLM,
            url=s.url,
            model=s.base_name,
            enable_lora=s.enable_lora,
            runtime_updating=s.runtime_updating,
            max_lora_rank=s.max_lora_rank,
            max_loras=s.max_loras,
            max_cpu_loras=s.max_cpu_loras,
            adapters=list(self.adapters if self.adapters is not None else self.last_listed),
            answered=self.up,
        )


OnRead = Callable[[list[EngineView], dict[str, EngineView]], Awaitable[None]]


async def read_engines(
    configured: Sequence[str], advertise_host: str | None = None
) -> list[EngineView]:
    """One read: the scan, then every server's /v1/models at once."""
    servers = await asyncio.wait_for(
        asyncio.to_thread(running_vllm_servers, configured, advertise_host), SCAN_TIMEOUT_S
    )
    adapters = await asyncio.gather(*(_adapters(s) for s in servers))
    return [EngineView(s, a) for s, a in zip(servers, adapters, strict=True)]


async def _adapters(server: VllmServer) -> tuple[str, ...] | None:
    try:
        async with VllmClient(server.url, server.api_key, timeout_s=MODELS_TIMEOUT_S) as c:
            return tuple(loaded_adapters(server, await c.models()))
    except VllmError:
        return None


class EngineWatch:
    """The last read of the engines, refreshed in its own task."""

    def __init__(
        self,
        configured: Sequence[str],
        refresh_s: float,
        node: str,
        advertise_host: str | None = None,
    ) -> None:
        self.configured = tuple(configured)
        self.advertise_host = advertise_host
        self.refresh_s = refresh_s
        self.views: dict[str, EngineView] = {}
        self.reads = 0
        self.on_read: OnRead | None = None
        self._wake = asyncio.Event()
        self.logger = log.get(node=node)

    def refs(self) -> list[EngineRef]:
        """What the heartbeat carries: the last read, never waited for."""
        return [v.ref() for v in self.views.values()]

    def server(self, url: str) -> VllmServer:
        """The engine at `url` as last read (its url alone when never read)."""
        view = self.views.get(url)
        return view.server if view is not None else VllmServer(url=url)

    def poke(self) -> None:
        """Read again now (after a load or an unload)."""
        self._wake.set()

    async def refresh(self) -> list[EngineView]:
        try:
            views = await read_engines(self.configured, self.advertise_host)
        except Exception as e:
            self.logger.warning(Event.ENGINES_READ_FAILED, error=repr(e))
            return list(self.views.values())
        views = [v.after(self.views.get(v.server.url)) for v in views]
        previous, self.views = self.views, {v.server.url: v for v in views}
        self.reads += 1
        if self.on_read is not None:
            await self.on_read(views, previous)
        return views

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self._wake.clear()
            await self.refresh()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.refresh_s)
