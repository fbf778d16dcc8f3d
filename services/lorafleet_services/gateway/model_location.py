"""Where a model is served: the one question the completions routes ask.

`ModelLocator` is the interface: `where(model)` gives the engines (OpenAI
base URL, the key they want, the name to send) that serve `model`, a
catalog base or a fine-tuned adapter; `served()` all of them, for `GET
/v1/models`. `EngineModels` asks the engines named in
`LORAFLEET_GATEWAY_ENGINES` (`GET <url>/models`), reusing the answers for
`ttl_s`; `fleet_model_location.FleetModelLocator` answers from the serving
records and the nodes' heartbeats.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Protocol

import httpx2
import msgspec

from lorafleet import log

#: Seconds one engine has to list its models.
ENGINE_LIST_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class ModelLocation:
    """An engine's OpenAI base URL (`http://host:port/v1`) and the Bearer key
    it wants; `served_name`: the name the engine knows the model by, sent as
    the request's `model` (None: the name the client gave)."""

    base_url: str
    api_key: str | None = None
    served_name: str | None = None


class ModelLocator(Protocol):
    async def where(self, model: str) -> list[ModelLocation]: ...

    async def served(self) -> dict[str, list[ModelLocation]]: ...

    def forget(self, model: str, location: ModelLocation) -> None:
        """Drop `location` of `model` from what is kept until the next renewal
        (its engine said it does not serve the model: unloaded a moment ago)."""
        ...


def without(locations: dict[str, list[ModelLocation]], model: str, location: ModelLocation) -> None:
    """Take `location` out of `locations[model]` (in place; the list is replaced, not changed)."""
    if model in locations:
        locations[model] = [r for r in locations[model] if r != location]


class _ModelEntry(msgspec.Struct):
    id: str


class _ModelList(msgspec.Struct):
    data: list[_ModelEntry]


class EngineModels:
    """`ModelLocator` from a fixed list of engines, by what each lists."""

    def __init__(
        self,
        engines: list[ModelLocation],
        http: httpx2.AsyncClient,
        ttl_s: float,
    ) -> None:
        self.engines = engines
        self.http = http
        self.ttl_s = ttl_s
        self._served: dict[str, list[ModelLocation]] = {}
        self._asked_at: float | None = None
        self._lock = asyncio.Lock()

    async def where(self, model: str) -> list[ModelLocation]:
        served = await self.served()
        if model not in served:
            served = await self._refresh()
        return served.get(model, [])

    async def served(self) -> dict[str, list[ModelLocation]]:
        fresh = self._asked_at is not None and time.monotonic() - self._asked_at < self.ttl_s
        return self._served if fresh else await self._refresh()

    def forget(self, model: str, location: ModelLocation) -> None:
        without(self._served, model, location)

    async def _refresh(self) -> dict[str, list[ModelLocation]]:
        async with self._lock:
            lists = await asyncio.gather(*(self._models_of(r) for r in self.engines))
            served: dict[str, list[ModelLocation]] = {}
            for location, models in zip(self.engines, lists, strict=True):
                for model in models:
                    served.setdefault(model, []).append(location)
            self._served, self._asked_at = served, time.monotonic()
            return served

    async def _models_of(self, location: ModelLocation) -> list[str]:
        """The models `location` lists; none when it does not answer (logged)."""
        headers = {"Authorization": f"Bearer {location.api_key}"} if location.api_key else {}
        try:
            reply = await self.http.get(
                f"{location.base_url}/models", headers=headers, timeout=ENGINE_LIST_TIMEOUT_S
            )
            reply.raise_for_status()
            return [m.id for m in msgspec.json.decode(reply.content, type=_ModelList).data]
        except (httpx2.HTTPError, msgspec.DecodeError) as e:
            log.get().warning(
                log.Event.GATEWAY_ENGINE_UNAVAILABLE, engine=location.base_url, error=repr(e)
            )
            return []
