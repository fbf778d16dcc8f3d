"""The node's heartbeat, and the fence: its record in KV `<prefix>_nodes`, with a
per-message TTL.

Every `heartbeat_s` seconds the agent publishes its `Heartbeat` to
`$KV.<bucket>.<node>` with `msg_ttl=node_timeout_s`: when the last beat
expires the server leaves a MaxAge marker, which is how the scheduler
learns the node is gone. The beat is its own task at a fixed cadence, and
nothing training does can hold it up: card reads run in a thread with a
timeout, the installed engines are re-read in a thread every
`ENGINES_RESCAN_S`, and the running ones come from the engine watch's last
read, never from a call made for the beat. When the agent fences, and when
it moves to another server first (`fence_reason`, `fence_bound_s`,
`Heartbeater`'s move), is stated once in agent/DESIGN.md ("Fencing").
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime as dt
from collections.abc import Callable
from pathlib import Path

import nats.js.errors
from nats.js import JetStreamContext

import lorafleet_services.agent.node.cards as cards_mod
from lorafleet import log
from lorafleet.log import Event
from lorafleet.nats._bus import encode
from lorafleet.nats._natspy import client_of, move_to_another_server
from lorafleet.settings import Settings
from lorafleet_schemas.messages import Card, EngineRef, EnginesInstalled, Heartbeat
from lorafleet_services.agent.config import AgentConfig
from lorafleet_services.agent.node.installed_engines import find_engines

#: Seconds one NVML read may take before the beat goes out with the last cards.
BEAT_CARD_READ_TIMEOUT_S = 0.5
#: Seconds between re-reads of the installed engines.
ENGINES_RESCAN_S = 30.0
#: Whole seconds a round trip to the server may take after a failed beat
#: (nats-py's flush takes whole seconds) before NATS counts as unreachable.
REACH_TIMEOUT_S = 1
#: Seconds a move to another server may take at least, when the fence's
#: bound is nearer (or past). After the move's time nats-py may come back to
#: the server left (the others may be unreachable from here: addresses the
#: cluster advertises that this node cannot reach).
MOVE_MIN_S = 1.0


class CardReader:
    """NVML reads in one worker thread; a read that hangs never blocks the loop,
    and no second read is queued behind it (the last cards are kept)."""

    def __init__(self, read: Callable[[], list[Card]] = cards_mod.read_cards) -> None:
        self._read = read
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nvml")
        self._pending: asyncio.Future[list[Card]] | None = None
        self.last: list[Card] = []

    async def read(self, timeout_s: float = BEAT_CARD_READ_TIMEOUT_S) -> list[Card]:
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
        serving: Callable[[], list[EngineRef]] = list,
    ) -> None:
        self.js = js
        self.settings = settings
        self.cfg = cfg
        self.version = version
        self.current_job = current_job
        #: The running engines' last read (agent/serving/engine_watch.py): never waited for.
        self.serving = serving
        self.started_at = dt.datetime.now(dt.UTC)
        #: Beats composed so far (`count_beat`), acknowledged or not.
        self.composed = 0
        self.cards = card_reader or CardReader()
        self.engines = EnginesInstalled()
        self._engines_read_at = -ENGINES_RESCAN_S
        self._wake = asyncio.Event()
        self._said_no_cards = False
        loop = asyncio.get_running_loop()
        #: loop.time() of the last acknowledged beat (fencing reads it).
        self.last_ack = loop.time()
        #: loop.time() the server last answered (an ack, a JetStream error,
        #: or a PONG after a failed beat): NATS was reachable then.
        self.last_reached = self.last_ack
        #: Why the last beat failed ("" after an acknowledged one).
        self.last_error = ""
        #: Seconds between two moves to another server at most (see the module doc).
        self.move_every_s = settings.node_timeout_s / 2
        self._moved_at = -self.move_every_s
        #: Moves to another server after beats the server answered but did not store.
        self.moves = 0
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
                    BEAT_CARD_READ_TIMEOUT_S,
                )
            except Exception as e:
                self.logger.warning(Event.HEARTBEAT_SLOW, error=repr(e))
        return self.engines

    def count_beat(self) -> int:
        """One more beat composed: its number (StartReply.accepted_beat)."""
        self.composed += 1
        return self.composed

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
            beat=self.count_beat(),  # with `job`, no await between: the count orders them
            cpu_training=self.cfg.allow_cpu and not cards,
            heartbeat_s=self.settings.heartbeat_s,
            ttl_s=self.settings.node_timeout_s,
            serving=self.serving(),
        )

    async def beat(self) -> bool:
        """Publish one beat; True when the server acknowledged it."""
        hb = await self.record()
        nc = client_of(self.js)
        received, sent_at = nc.stats["in_msgs"], asyncio.get_running_loop().time()
        try:
            await self.js.publish(
                self.subject,
                encode(hb),
                timeout=max(0.2, min(self.settings.heartbeat_s, 2.0)),
                msg_ttl=self.settings.node_timeout_s,
            )
        except Exception as e:
            self.last_error = repr(e)
            # An error reply is an answer: the server is there, the bucket is not.
            answered = isinstance(
                e, (nats.js.errors.NoStreamResponseError, nats.js.errors.APIError)
            )
            # So is any message that came in meanwhile: on a link our own
            # artifact chunks fill, the beat's ack and a PING's PONG can
            # wait behind them longer than their timeouts while the chunks'
            # acks go on arriving (tests/partition pins it on a slow link).
            # (Reached when the beat went out, at the latest: the message
            # may have been sent any time since.)
            heard = answered or nc.stats["in_msgs"] > received
            if answered:
                self.last_reached = asyncio.get_running_loop().time()
            elif heard:
                self.last_reached = max(self.last_reached, sent_at)
            # The move comes first, before any PING: on a cut-off or frozen
            # server the node timeout is all the time there is, and the
            # move must try every other server within it
            # (tests/agent/test_heartbeat_moves.py).
            # A cut link reaches none, and the fence goes on as it was.
            why = "the server answered but stored no beat" if answered else "no answer to the beat"
            moved = nc.is_connected and await self._move(why)
            reached = heard or moved or await self._reach()
            self.logger.warning(Event.HEARTBEAT_FAILED, error=repr(e), nats_reachable=reached)
            return False
        self.last_ack = self.last_reached = asyncio.get_running_loop().time()
        self.last_error = ""
        return True

    async def _reach(self) -> bool:
        """After a failed beat: does the server answer at all (PING/PONG)?"""
        nc = client_of(self.js)
        if not nc.is_connected:
            return False
        try:
            await nc.flush(timeout=REACH_TIMEOUT_S)
        except Exception:
            return False
        self.last_reached = asyncio.get_running_loop().time()
        return True

    async def _move(self, why: str) -> bool:
        """To another server of the cluster, unless moved lately or there is
        none; True once on another server. Every other server of the pool
        is tried before the fence's bound (the last acknowledged beat plus
        `fence_bound_s`), `_natspy.MOVE_TRY_MIN_S` each at least."""
        nc = client_of(self.js)
        loop = asyncio.get_running_loop()
        now = loop.time()
        if now - self._moved_at < self.move_every_s or len(nc.servers) < 2:
            return False
        self._moved_at = now
        left = nc.connected_url.netloc if nc.connected_url else ""
        within_s = self.last_ack + fence_bound_s(self.settings.node_timeout_s) - now
        if not await move_to_another_server(nc, max(within_s, MOVE_MIN_S)):
            self.logger.warning(
                Event.NATS_ERROR,
                error="no other server took us",
                left=left,
                within_s=round(loop.time() - now, 2),
            )
            return False
        self.moves += 1
        self.last_reached = loop.time()
        self._wake.set()  # beat from the new server now, not a period later
        self.logger.warning(
            Event.NATS_MOVED,
            left=left,
            server=nc.connected_url.netloc if nc.connected_url else "",
            message=why,
        )
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


#: Seconds past the node timeout an agent keeps its trainer while its server
#: answers but the heartbeat bucket takes no beat. A JetStream election
#: takes seconds (about 5-7 s after a leader's server dies); past this,
#: something else is wrong (this server cut off from the others, say) and
#: the agent fences as if NATS were unreachable.
BUCKET_OUTAGE_PATIENCE_S = 30.0


#: Seconds before the node timeout an agent that cannot reach NATS fences.
#: The beat's TTL runs from when the server stored it, a little before its
#: ack came back, and the fence is checked every quarter second: at the node
#: timeout itself the agent could still hold a job the scheduler has just
#: sent elsewhere (tests/agent/test_units.py).
FENCE_MARGIN_S = 0.5


def fence_bound_s(timeout_s: float) -> float:
    """Seconds of silence after which an agent that cannot reach NATS fences."""
    return max(timeout_s - FENCE_MARGIN_S, timeout_s / 2)


def fence_reason(silent_s: float, unreachable_s: float, timeout_s: float) -> str | None:
    """Why the agent must fence now, or None.

    silent_s: seconds since the last acknowledged beat; unreachable_s:
    seconds since the server last answered at all; timeout_s: the node
    timeout. An agent that cannot reach NATS for the node timeout is
    presumed lost (its job failed), so it fences `FENCE_MARGIN_S` before
    (`fence_bound_s`); one whose server answers while the bucket elects a
    leader is not (the scheduler is blind to it too).
    """
    bound_s = fence_bound_s(timeout_s)
    if silent_s <= bound_s:
        return None
    if unreachable_s > bound_s:
        return f"no heartbeat acknowledged and NATS unreachable for {unreachable_s:.1f} s"
    if silent_s > timeout_s + BUCKET_OUTAGE_PATIENCE_S:
        return f"NATS answers, but no heartbeat has been stored for {silent_s:.1f} s"
    return None
