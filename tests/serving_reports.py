"""A node's serving reports, read from the status stream in order (the
agent's ServingReports on `<prefix>.status.<node>.*.serving`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import msgspec
import nats
from nats.js import JetStreamContext

from lorafleet.names import Names
from lorafleet_schemas.messages import ServingReport, ServingState

#: A load with its PEFT probe: tens of seconds on two busy cores.
SERVE_TIMEOUT_S = 300.0


class ServingReports:
    """A node's serving reports, read from the status stream in order."""

    def __init__(self, sub: Any) -> None:
        self.sub = sub
        self.items: list[ServingReport] = []
        self.read = 0

    async def next(
        self, pred: Callable[[ServingReport], bool], timeout_s: float = SERVE_TIMEOUT_S
    ) -> ServingReport:
        """The first report after the last one returned that matches `pred`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            while self.read < len(self.items):
                r = self.items[self.read]
                self.read += 1
                if pred(r):
                    return r
            left = deadline - loop.time()
            if left <= 0:
                raise AssertionError(f"no such serving report; got {self.summary()}")
            try:
                msg = await self.sub.next_msg(timeout=left)
            except nats.errors.TimeoutError:
                continue
            self.items.append(msgspec.json.decode(msg.data, type=ServingReport, strict=True))

    @classmethod
    async def of_node(cls, js: JetStreamContext, names: Names, node: str) -> ServingReports:
        return cls(await js.subscribe(f"{names.prefix}.status.{node}.*.serving",
                                      ordered_consumer=True))  # fmt: skip

    def summary(self) -> list[str]:
        return [f"{r.seq}:{r.served_name}:{r.state}:{r.reason}" for r in self.items]


def of(job_id: str, *states: ServingState) -> Callable[[ServingReport], bool]:
    return lambda r: r.job_id == job_id and r.state in states
