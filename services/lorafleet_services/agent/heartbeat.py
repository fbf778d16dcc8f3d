"""The node's heartbeat: its record in KV `lorafleet_nodes`, with a per-message TTL.

Every `heartbeat_s` seconds the agent publishes its `Heartbeat` to
`$KV.<bucket>.<node>` with `msg_ttl=node_timeout_s` (whole seconds): when
the last beat expires the server leaves a MaxAge purge marker, which is how
the scheduler's KV watcher learns the node is gone.

The beat is its own asyncio task and nothing training does can hold it up:
the trainer is another process, card reads (NVML calls block) run in a
thread with a timeout, and the engines are re-read in a thread every
`ENGINES_RESCAN_S`. The beats keep a fixed cadence (deadline-based sleeps,
so a slow publish does not push every later beat back).

The time of the last acknowledged beat is what fencing measures: an agent
whose beats have not been acknowledged for `node_timeout_s` is presumed
dead by the scheduler, which has failed its job.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime as dt
from collections.abc import Callable
from pathlib import Path

from nats.js import JetStreamContext

from lorafleet import log
from lorafleet._bus import encode
from lorafleet.log import Event
from lorafleet.settings import Settings
from lorafleet_schemas.messages import Card, EnginesInstalled, Heartbeat
from lorafleet_services.agent import cards as cards_mod
from lorafleet_services.agent.config import AgentConfig
from lorafleet_services.agent.engines import find_engines

#: Seconds one NVML read may take before the beat goes out with the last cards.
CARD_READ_TIMEOUT_S = 0.5
#: Seconds between re-reads of the installed engines.
ENGINES_RESCAN_S = 30.0


class CardReader:
    """NVML reads in one worker thread; a read that hangs never blocks the loop,
    and no second read is queued behind it (the last cards are kept)."""

    def __init__(self, read: Callable[[], list[Card]] = cards_mod.read_cards) -> None:
        self._read = read
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nvml")
        self._pending: asyncio.Future[list[Card]] | None = None
        self.last: list[Card] = []

    async def read(self, timeout_s: float = CARD_READ_TIMEOUT_S) -> list[Card]:
        loop = asyncio.get_running_loop()
        if self._pending is None or self._pending.done():
            self._pending = loop.run_in_executor(self._pool, self._read)
        try:
            self.last = await asyncio.wait_for(asyncio.shield(self._pending), timeout_s)
        except TimeoutError:
            log.get().warning(Event.HEARTBEAT_SLOW, message="reading the cards took too long")
        except Exception as e:
            log.get().warning(Event.HEARTBEAT_SLOW, error=repr(e))
        return self.last

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class Heartbeater:
    """Publishes the node's heartbeat until stopped; `poke()` sends one now."""

    def __init__(
        self,
        js: JetStreamContext,
        settings: Settings,
        cfg: AgentConfig,
        *,
        version: str,
        current_job: Callable[[], str | None],
        card_reader: CardReader | None = None,
    ) -> None:
        self.js = js
        self.settings = settings
        self.cfg = cfg
        self.version = version
        self.current_job = current_job
        self.started_at = dt.datetime.now(dt.UTC)
        self.cards = card_reader or CardReader()
        self.engines = EnginesInstalled()
        self._engines_read_at = -ENGINES_RESCAN_S
        self._wake = asyncio.Event()
        self._said_no_cards = False
        loop = asyncio.get_running_loop()
        #: loop.time() of the last acknowledged beat (fencing reads it).
        self.last_ack = loop.time()
        self.beats = 0
        self.subject = settings.names.node_heartbeat(cfg.node)
        self.logger = log.get(node=cfg.node)

    def poke(self) -> None:
        """Beat now (a job started or ended: the scheduler should know at once)."""
        self._wake.set()

    async def _engines(self) -> EnginesInstalled:
        loop = asyncio.get_running_loop()
        if loop.time() - self._engines_read_at >= ENGINES_RESCAN_S:
            self._engines_read_at = loop.time()
            try:
                self.engines = await asyncio.wait_for(
                    asyncio.to_thread(
                        find_engines, Path(self.cfg.engines_dir), self.cfg.llamacpp_tag
                    ),
                    CARD_READ_TIMEOUT_S,
                )
            except Exception as e:
                self.logger.warning(Event.HEARTBEAT_SLOW, error=repr(e))
        return self.engines

    async def record(self) -> Heartbeat:
        cards = await self.cards.read()
        if not cards and not self._said_no_cards:
            self._said_no_cards = True
            ok, why = cards_mod.nvml_available()
            self.logger.info(
                Event.NODE_NO_CARDS,
                message=why if not ok else "NVML sees no card",
                cpu_training=self.cfg.allow_cpu,
            )
        return Heartbeat(
            node=self.cfg.node,
            version=self.version,
            started_at=self.started_at,
            time=dt.datetime.now(dt.UTC),
            cards=cards,
            engines=await self._engines(),
            job=self.current_job(),
            cpu_training=self.cfg.allow_cpu and not cards,
            heartbeat_s=self.settings.heartbeat_s,
            ttl_s=self.settings.node_timeout_s,
        )

    async def beat(self) -> bool:
        """Publish one beat; True when the server acknowledged it."""
        hb = await self.record()
        try:
            await self.js.publish(
                self.subject,
                encode(hb),
                timeout=max(0.2, min(self.settings.heartbeat_s, 2.0)),
                msg_ttl=self.settings.node_timeout_s,
            )
        except Exception as e:
            self.logger.warning(Event.HEARTBEAT_FAILED, error=repr(e))
            return False
        self.last_ack = asyncio.get_running_loop().time()
        self.beats += 1
        return True

    async def run(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        period = self.settings.heartbeat_s
        next_at = loop.time()
        try:
            while not stop.is_set():
                self._wake.clear()
                await self.beat()
                next_at += period
                now = loop.time()
                if next_at < now:  # fell behind (a slow publish): skip, do not burst
                    next_at = now + period
                try:
                    await asyncio.wait_for(self._wake.wait(), next_at - now)
                    # A poked beat resets the cadence from now.
                    next_at = loop.time()
                except TimeoutError:
                    pass
        finally:
            self.cards.close()
