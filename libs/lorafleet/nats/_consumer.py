"""The one JetStream pull-consumer loop: fetch batches, hand them over, ack after apply.

Every service that consumes a stream (the recorder's status reports, the
artifact-store's chunks) runs one `PullConsumer(js, PullConsumerConfig(...),
handle=...)`: the next batch is fetched while `handle` applies this one;
`handle` acks each message once its effect is durable (the loop never
acks; what it leaves is nakked when it raises, and the loop backs off); a
slow batch is kept from redelivery for up to `max_hold_s`; fetch errors are
retried, a deleted durable re-created (it replays the stream: a replay must
change nothing), and a changed ack wait applied at start; `stop()` finishes
the batches in hand. Each behaviour and why: libs/lorafleet/DESIGN.md.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import nats.js.errors
import stamina
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

import lorafleet.log as log
from lorafleet._tasks import within
from lorafleet.log import Event

BatchHandler = Callable[[list[Msg]], Awaitable[None]]
Hook = Callable[[], Awaitable[None]]

#: Seconds between checks, while fetches come back empty, that the durable consumer exists.
CONSUMER_CHECK_S = 10.0
#: Seconds of the first pause after a failed fetch or batch; it doubles with
#: each failure in a row (stamina), up to RETRY_WAIT_MAX_S.
RETRY_WAIT_INITIAL_S = 0.5
#: Seconds of the longest pause between two failed fetches or batches.
RETRY_WAIT_MAX_S = 5.0
#: Seconds of random jitter added to each pause (replicas do not retry in step).
RETRY_JITTER_S = 0.1
#: Seconds `stop()` waits for the batch in hand before cancelling the loop.
STOP_TIMEOUT_S = 10.0
#: A batch in hand is told "in progress" every this fraction of the ack wait.
HOLD_EVERY = 1 / 3
#: Seconds a batch is kept from redelivery at most: a handler slower than
#: this is taken for stuck.
MAX_HOLD_S = 120.0


@dataclass(frozen=True, slots=True)
class PullConsumerConfig:
    """The durable pull consumer a service reads a stream through.

    stream: the stream's name.
    durable: the durable consumer's name (shared by replicas of a service).
    filter_subject: the subjects it delivers (wildcards allowed).
    ack_wait_s: seconds the server waits for an ack before redelivering.
    max_ack_pending: messages delivered and not yet acked, at most.
    batch: messages fetched at once, at most.
    fetch_wait_s: seconds one fetch waits for its first message; default 1.
    max_hold_s: seconds a batch in hand is kept from redelivery at most;
        default MAX_HOLD_S (120).
    """

    stream: str
    durable: str
    filter_subject: str
    ack_wait_s: float
    max_ack_pending: int
    batch: int
    fetch_wait_s: float = 1.0
    max_hold_s: float = MAX_HOLD_S

    def consumer_config(self) -> ConsumerConfig:
        """The server-side consumer: explicit ack, from the stream's start, never given up."""
        return ConsumerConfig(
            durable_name=self.durable,
            filter_subject=self.filter_subject,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            ack_wait=self.ack_wait_s,
            max_ack_pending=self.max_ack_pending,
            max_deliver=-1,
        )


def _backoff(on: type[Exception] | Callable[[Exception], bool]) -> AsyncIterator[stamina.Attempt]:
    """Tries until one succeeds (no limit), pausing RETRY_WAIT_INITIAL_S, doubling
    up to RETRY_WAIT_MAX_S, after each failure `on` accepts."""
    return stamina.retry_context(
        on=on,
        attempts=None,
        timeout=None,
        wait_initial=RETRY_WAIT_INITIAL_S,
        wait_max=RETRY_WAIT_MAX_S,
        wait_jitter=RETRY_JITTER_S,
    )


class BatchFailedError(Exception):
    """The handler raised for a batch; its messages were nakked."""


class PullConsumer:
    """One durable pull consumer, fetched and handled until `stop()`.

    js: the JetStream context to consume through.
    config: the consumer (see PullConsumerConfig).
    handle: called with each batch (1..config.batch messages); acks them.
    ensure_stream: called before the consumer is re-created; default none.
    on_tick / tick_s: a hook run before each batch and every `tick_s`
        seconds without one; default none.
    check_every_s: seconds of idle fetching between checks that the durable
        consumer exists; default CONSUMER_CHECK_S (10).
    """

    def __init__(
        self,
        js: JetStreamContext,
        config: PullConsumerConfig,
        handle: BatchHandler,
        *,
        ensure_stream: Hook | None = None,
        on_tick: Hook | None = None,
        tick_s: float | None = None,
        check_every_s: float = CONSUMER_CHECK_S,
    ) -> None:
        if (on_tick is None) != (tick_s is None):
            raise ValueError("on_tick and tick_s go together")
        self.js = js
        self.config = config
        self.handle = handle
        self.ensure_stream = ensure_stream
        self.on_tick = on_tick
        self.tick_s = tick_s
        self.check_every_s = check_every_s
        self.logger = log.get()
        self._sub: JetStreamContext.PullSubscription | None = None
        self._stopping = asyncio.Event()
        # None after the last batch: the fetcher is done.
        self._batches: asyncio.Queue[list[Msg] | None] = asyncio.Queue(maxsize=1)
        self._task: asyncio.Task[None] | None = None
        #: Batches fetched and not yet handled (by id), with their loop time of fetch.
        self._in_hand: dict[int, tuple[list[Msg], float]] = {}
        self._handled = asyncio.Event()

    async def start(self) -> None:
        """Subscribe (creating the durable consumer if missing) and start the loop."""
        self._sub = await self._subscribe()
        self._task = asyncio.create_task(self._run(), name=f"{self.config.durable}-consumer")

    async def _run(self) -> None:
        # One group: should either loop fail (a bug), the other is cancelled
        # with it rather than left fetching for nobody or waiting forever.
        name = self.config.durable
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self._fetch_loop(), name=f"{name}-fetch")
                group.create_task(self._handle_loop(), name=f"{name}-handle")
                group.create_task(self._hold_loop(), name=f"{name}-hold")
        except Exception as e:
            self.logger.exception(Event.REQUEST_FAILED, error=repr(e), where=f"{name} loop")

    async def stop(self) -> None:
        """Finish the fetch in flight and the batches fetched, then unsubscribe."""
        self._stopping.set()
        if self._task is not None:
            with contextlib.suppress(TimeoutError):  # then it has been stopped
                await within(STOP_TIMEOUT_S, self._task)
            self._task = None
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None

    # --- fetching ----------------------------------------------------------------

    async def _subscribe(self) -> JetStreamContext.PullSubscription:
        c = self.config
        sub = await self.js.pull_subscribe(
            c.filter_subject, durable=c.durable, stream=c.stream, config=c.consumer_config()
        )
        await self._update_settings()
        return sub

    async def _update_settings(self) -> None:
        """An existing durable consumer gets this config's ack wait and max ack
        pending (both editable in place; its position is kept)."""
        c = self.config
        try:
            held = (await self.js.consumer_info(c.stream, c.durable)).config
            same_wait = held.ack_wait is not None and abs(held.ack_wait - c.ack_wait_s) < 1e-3
            if same_wait and held.max_ack_pending == c.max_ack_pending:
                return
            await self.js.add_consumer(c.stream, config=c.consumer_config())
        except Exception as e:
            # Consuming with the old settings beats not consuming at all.
            self.logger.warning(
                Event.NATS_ERROR,
                error=repr(e),
                where=f"{c.durable} settings",
                message="the consumer keeps the settings it has",
            )
            return
        self.logger.info(
            Event.CONSUMER_UPDATED,
            consumer=c.durable,
            ack_wait_s=c.ack_wait_s,
            was_ack_wait_s=held.ack_wait,
            max_ack_pending=c.max_ack_pending,
        )

    async def _fetch_loop(self) -> None:
        loop = asyncio.get_running_loop()
        last_check = loop.time()
        while not self._stopping.is_set():
            try:
                msgs = await self._fetch()
            except Exception:
                break  # a failure while stopping: every other one is retried
            if msgs:
                self._in_hand[id(msgs)] = (msgs, loop.time())
                await self._batches.put(msgs)
            elif loop.time() - last_check >= self.check_every_s:
                # Idle: now and then make sure there is a consumer to idle on.
                last_check = loop.time()
                await self._ensure_consumer()
        await self._batches.put(None)

    async def _fetch(self) -> list[Msg]:
        """One batch; [] when none came within fetch_wait_s. Errors are retried."""
        async for attempt in _backoff(self._fetch_failed):
            with attempt:
                if attempt.num > 1:
                    # The consumer may be what failed (deleted, or a new store).
                    await self._ensure_consumer()
                sub = self._sub
                if sub is None or self._stopping.is_set():
                    return []
                try:
                    return await sub.fetch(self.config.batch, timeout=self.config.fetch_wait_s)
                except TimeoutError:  # nats.errors.TimeoutError is one
                    return []
        return []  # not reached: attempts=None retries until a fetch works

    def _fetch_failed(self, e: Exception) -> bool:
        # Server restarting, connection re-establishing, consumer gone.
        self.logger.warning(Event.NATS_ERROR, error=repr(e), where=f"{self.config.durable} fetch")
        return not self._stopping.is_set()

    async def _ensure_consumer(self) -> None:
        """Re-create the durable consumer if it is gone (deleted, or a new server store).

        The new consumer replays the stream from its start; the handler makes
        a replay change nothing, so that costs time, not correctness.
        """
        c = self.config
        try:
            await self.js.consumer_info(c.stream, c.durable)
            return
        except nats.js.errors.NotFoundError:
            pass
        except Exception:
            return  # the server is not answering yet: the next fetch error retries
        self.logger.warning(
            Event.NATS_ERROR,
            error=f"the durable consumer {c.durable} on {c.stream} is gone",
            message="re-creating it; the stream replays from its start",
        )
        try:
            if self.ensure_stream is not None:
                await self.ensure_stream()
            old, self._sub = self._sub, await self._subscribe()
        except Exception as e:
            self.logger.warning(Event.NATS_ERROR, error=repr(e), where=f"{c.durable} re-subscribe")
            return
        if old is not None:
            with contextlib.suppress(Exception):
                await old.unsubscribe()

    # --- handling ----------------------------------------------------------------

    async def _handle_loop(self) -> None:
        more = True
        try:
            while more:
                async for attempt in _backoff(BatchFailedError):
                    with attempt:
                        more = await self._handle_next()
        finally:
            self._handled.set()

    async def _hold_loop(self) -> None:
        """Tell the server "in progress" for each unacked message of a batch in
        hand longer than HOLD_EVERY of the ack wait (see the module docstring)."""
        every_s = self.config.ack_wait_s * HOLD_EVERY
        loop = asyncio.get_running_loop()
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._handled.wait(), every_s)
            if self._handled.is_set():
                return
            now = loop.time()
            for key, (batch, since) in list(self._in_hand.items()):
                if now - since < every_s:
                    continue
                unacked = [m for m in batch if not m.is_acked]
                if now - since > self.config.max_hold_s:
                    del self._in_hand[key]
                    self.logger.warning(
                        Event.CONSUMER_HOLD_EXPIRED,
                        consumer=self.config.durable,
                        messages=len(unacked),
                        held_s=round(now - since, 1),
                    )
                    continue
                for m in unacked:
                    with contextlib.suppress(Exception):  # gone: the ack wait decides
                        await m.in_progress()

    async def _handle_next(self) -> bool:
        """Take the next batch (or a tick) and handle it; False once the fetcher is done."""
        try:
            if self.tick_s is None:
                batch = await self._batches.get()
            else:
                batch = await asyncio.wait_for(self._batches.get(), self.tick_s)
        except TimeoutError:
            batch = []
        if batch is None:
            return False
        await self._tick()
        if batch:
            await self._handle(batch)
        return True

    async def _tick(self) -> None:
        if self.on_tick is None:
            return
        try:
            await self.on_tick()
        except Exception as e:
            self.logger.exception(
                Event.REQUEST_FAILED, error=repr(e), where=f"{self.config.durable} tick"
            )

    async def _handle(self, batch: list[Msg]) -> None:
        try:
            await self.handle(batch)
        except Exception as e:
            self.logger.exception(
                Event.REQUEST_FAILED, error=repr(e), where=f"{self.config.durable} handler"
            )
            # Unacked messages come back after the ack wait; nak them sooner.
            for m in batch:
                with contextlib.suppress(Exception):  # acked already: nothing to undo
                    await m.nak(delay=RETRY_WAIT_INITIAL_S)
            raise BatchFailedError(repr(e)) from e
        finally:
            # What the handler left unacked (a held chunk) is its own to keep now.
            self._in_hand.pop(id(batch), None)
