"""Reading one subject of a stream in order, by batched direct gets.

nats-py has no batched direct get (`$JS.API.DIRECT.GET.<stream>` with
`batch`, nats-server 2.11 on): `SubjectReader` asks for a batch at a time
on an inbox of its own and takes the answer apart (each message's
`Nats-Sequence`, the end-of-batch status). Any replica of a stream with
allow_direct answers, so where direct gets fail (no allow_direct, a replica
behind the leader, a refused subject) the rest comes by the leader's
message gets. `_natspy.read_object` reads an object's chunks with it.
"""

from __future__ import annotations

import contextlib
import json

import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext

from lorafleet.names import STATUS_END_OF_BATCH, Header, stream_direct_get_subject

#: Object chunks one batched direct get asks for (16 x 512 KiB: 8 MiB a
#: batch; two are in flight at the end of each).
DIRECT_GET_BATCH = 16
#: Seconds to wait for the next message of a batched direct get's answer.
DIRECT_GET_WAIT_S = 5.0


class SubjectReader:
    """The messages of one subject of a stream, in order, a batch at a time:
    batched direct gets while they work, message gets after.

    The next batch is asked for as soon as this one's last message is in,
    so the server sends it while the caller writes this one (each request
    answers on its own inbox token: a late end-of-batch, or a replica's
    late answer, is told apart from the batch in hand).
    """

    def __init__(self, js: JetStreamContext, nc: Client, stream: str, subject: str) -> None:
        self.js = js
        #: The connection `js` was made from (`_natspy.client_of`).
        self.nc = nc
        self.stream = stream
        self.subject = subject
        #: The stream sequence to read from next, and messages read so far.
        self.seq = 1
        self.read = 0
        self.direct = True
        self._sub: Subscription | None = None
        self._inbox = ""
        #: The reply token of the batch asked for and not yet taken (0: none), and its size.
        self._asked = 0
        self._asked_n = 0
        self._tokens = 0

    async def __aenter__(self) -> SubjectReader:
        self._inbox = self.nc.new_inbox()
        self._sub = await self.nc.subscribe(self._inbox + ".*")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()

    async def next_batch(self, left: int) -> list[bytes]:
        """Up to `left` more messages' data (at least one); [] when the subject has no more."""
        batch = await self._direct(left) if self.direct else []
        if not batch:
            try:
                msg = await self.js.get_msg(self.stream, seq=self.seq, subject=self.subject,
                                            next=True)  # fmt: skip
            except nats.js.errors.NotFoundError:
                return []
            batch = [msg.data or b""]
            self.seq = (msg.seq or self.seq) + 1
        self.read += len(batch)
        return batch

    async def _ask(self, n: int) -> None:
        self._tokens += 1
        self._asked, self._asked_n = self._tokens, n
        request = {"seq": self.seq, "next_by_subj": self.subject, "batch": n}
        await self.nc.publish(
            stream_direct_get_subject(self.stream),
            json.dumps(request).encode(),
            reply=f"{self._inbox}.{self._asked}",
        )

    async def _direct(self, left: int) -> list[bytes]:
        """The batch asked for (asked now if it was not), the next one asked
        for once it is in; what came before it fell short (then `direct` is
        off: the rest comes by message gets)."""
        sub = self._sub
        if sub is None:
            raise RuntimeError("read within `async with SubjectReader(...)`")
        if not self._asked:
            await self._ask(min(left, DIRECT_GET_BATCH))
        token, n = f"{self._inbox}.{self._asked}", self._asked_n
        self._asked = 0
        batch: list[bytes] = []
        while len(batch) < n:
            try:
                msg = await sub.next_msg(timeout=DIRECT_GET_WAIT_S)
            except nats.errors.TimeoutError:
                break
            headers = msg.headers or {}
            if msg.subject != token:
                continue  # an earlier batch's end
            if headers.get(Header.STATUS) == STATUS_END_OF_BATCH:
                return batch
            if Header.STATUS in headers or Header.SEQUENCE not in headers:
                break  # no direct gets here (503), or a replica behind (404)
            batch.append(msg.data)
            self.seq = int(headers[Header.SEQUENCE]) + 1
            if Header.NUM_PENDING not in headers:
                return batch  # an older server answers one message, no batch
        else:
            if left > n:
                await self._ask(min(left - n, DIRECT_GET_BATCH))
            return batch
        self.direct = False
        return batch
