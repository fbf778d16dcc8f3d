"""Which replica a completion goes to: the one with the fewest requests in
flight, not the next in turn.

`Loads` counts this gateway's own requests in flight per engine (from the
send to the end of the answer, a stream's last chunk included), and adds
what each engine says it runs and queues beyond them
(`vllm:num_requests_running` + `vllm:num_requests_waiting` from its
`/metrics`, read every `METRICS_EVERY_S` by `scrape`; the others' share is
what the engine counted less what this gateway had in flight when it
read). `ranked` orders a model's locations by that load, a turn counter
breaking ties so equal replicas still alternate; the request goes to the
first, and to the next when an engine refuses the connection or fails
before its first byte (inference_routes.py).
"""

from __future__ import annotations

import asyncio
import itertools
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import httpx2

from lorafleet_services.gateway.model_location import ModelLocation

#: Seconds between two reads of the engines' /metrics (a load older than
#: this is still used: the own count is live, the engine's only adds others').
METRICS_EVERY_S = 1.0
#: Seconds one engine has to answer /metrics.
METRICS_TIMEOUT_S = 1.0
#: The engine gauges a request in flight shows up in (vLLM's names).
ENGINE_LOAD_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?\s+(\S+)", re.MULTILINE)


def engine_load(metrics_text: str) -> float | None:
    """Requests running and waiting, summed over the engine's series, from
    Prometheus text; None when it has neither gauge."""
    values = [
        float(m.group(2))
        for m in _SAMPLE.finditer(metrics_text)
        if m.group(1) in ENGINE_LOAD_GAUGES
    ]
    return sum(values) if values else None


def metrics_url(base_url: str) -> str:
    """An engine's /metrics, beside (not under) its OpenAI `/v1`."""
    return f"{base_url.rstrip('/').removesuffix('/v1')}/metrics"


@dataclass
class Loads:
    """Requests in flight per engine base URL (module doc)."""

    #: base URL -> this gateway's requests in flight there now.
    own: dict[str, int] = field(default_factory=dict)
    #: base URL -> requests the engine counted that were not this gateway's, at its last read.
    others: dict[str, float] = field(default_factory=dict)
    _turn: Iterator[int] = field(default_factory=itertools.count)

    def load(self, base_url: str) -> float:
        return self.own.get(base_url, 0) + self.others.get(base_url, 0.0)

    def ranked(self, locations: Sequence[ModelLocation]) -> list[ModelLocation]:
        """`locations`, least loaded first; equal loads in a rotating order."""
        if not locations:
            return []
        turn = next(self._turn) % len(locations)
        rotated = [*locations[turn:], *locations[:turn]]
        return sorted(rotated, key=lambda loc: self.load(loc.base_url))

    def begin(self, base_url: str) -> None:
        """One more in flight at `base_url` (for an answer that ends later: `end`)."""
        self.own[base_url] = self.own.get(base_url, 0) + 1

    def end(self, base_url: str) -> None:
        self.own[base_url] = max(0, self.own.get(base_url, 0) - 1)

    def engine_said(self, base_url: str, running_and_waiting: float, own_then: int) -> None:
        self.others[base_url] = max(0.0, running_and_waiting - own_then)

    async def scrape(self, http: httpx2.AsyncClient, base_urls: Sequence[str]) -> None:
        """Read every engine's load once, all at once; one that does not
        answer keeps its last value (its own count still steers)."""
        await asyncio.gather(*(self._scrape_one(http, url) for url in base_urls))

    async def _scrape_one(self, http: httpx2.AsyncClient, base_url: str) -> None:
        own_then = self.own.get(base_url, 0)
        try:
            reply = await http.get(metrics_url(base_url), timeout=METRICS_TIMEOUT_S)
        except httpx2.HTTPError:
            return
        if reply.status_code == 200:
            said = engine_load(reply.text)
            if said is not None:
                self.engine_said(base_url, said, own_then)
