"""`ModelLocator` from the control plane: the engines that serve a model, as
the serving records and the nodes' heartbeats say.

A fine-tuned name (`ft:<base>:<suffix>:<job>`) goes to each engine holding
a served record of `<job>` on a live node whose heartbeat lists that
engine, `model` rewritten to the record's served name; a catalog base goes
to each engine of a live node whose base model is that entry. The view
(`fleet_view`, a plain function of the served records, read page by page
in key order, the nodes and the catalog) is reused for `ttl_s`
and renewed beside the requests; a miss asks again at once; a location whose
engine answered 404 is dropped (`forget`). `ConfiguredFirstLocator` puts
LORAFLEET_GATEWAY_ENGINES first. What an operator must give (engine
addresses the gateway can reach): docs/deploy.md.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from lorafleet import log
from lorafleet.client import Client
from lorafleet.fleet_serving import serves_base
from lorafleet_schemas.messages import (
    LIST_MAX,
    AdapterKey,
    ModelRecord,
    NodeInfo,
    ServingRecord,
    ServingState,
)
from lorafleet_services.gateway.job_mapping import fine_tuned_parts
from lorafleet_services.gateway.model_location import ModelLocation, ModelLocator, without

#: Most pages of them one view reads; past that the view is cut, and a
#: warning says so.
MAX_SERVED_PAGES = 50


def engine_base_url(url: str) -> str:
    """An engine's OpenAI base URL (`.../v1`) from its url on its node."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else f"{url}/v1"


@dataclass
class FleetView:
    """job id -> its locations; catalog model -> its locations (each with the name to send)."""

    by_job: dict[str, list[ModelLocation]] = field(default_factory=dict)
    by_base: dict[str, list[ModelLocation]] = field(default_factory=dict)
    #: job id -> the base its served records are of.
    job_base: dict[str, str] = field(default_factory=dict)
    #: node -> the base URLs of its engines in this view.
    by_node: dict[str, set[str]] = field(default_factory=dict)

    def without_node(self, node: str) -> None:
        """Every location on `node` out (in place; the lists are replaced)."""
        urls = self.by_node.pop(node, set())
        for table in (self.by_job, self.by_base):
            for key, locations in list(table.items()):
                table[key] = [loc for loc in locations if loc.base_url not in urls]


def fleet_view(
    records: Iterable[ServingRecord],
    nodes: Iterable[NodeInfo],
    catalog: Iterable[ModelRecord],
    api_key: str | None = None,
) -> FleetView:
    """Where each served adapter and each catalog base can be asked now."""
    engines = {(n.heartbeat.node, e.url): e for n in nodes if n.alive for e in n.heartbeat.serving}
    view = FleetView()
    for node, url in engines:
        view.by_node.setdefault(node, set()).add(engine_base_url(url))
    for r in records:
        if r.state is not ServingState.SERVED or (r.node, r.engine) not in engines:
            continue  # a lost node, or an engine its node no longer runs
        location = ModelLocation(engine_base_url(r.engine), api_key, served_name=r.served_name)
        view.by_job.setdefault(r.job_id, []).append(location)
        view.job_base[r.job_id] = r.model
    for model in catalog:
        for (_, url), engine in sorted(engines.items()):
            if serves_base(engine, model):
                location = ModelLocation(engine_base_url(url), api_key, served_name=engine.model)
                view.by_base.setdefault(model.name, []).append(location)
    return view


def locations_in(view: FleetView, model: str) -> list[ModelLocation]:
    """The locations of `model` (a fine-tuned name or a catalog base) in `view`."""
    tuned = fine_tuned_parts(model)
    if tuned is None:
        return view.by_base.get(model, [])
    base, job_id = tuned
    return view.by_job.get(job_id, []) if view.job_base.get(job_id) == base else []


#: What a client of a fine-tuned model not served now should do, by where
#: its serving records stand (the newest change first decides).
_UNSERVED_HINTS = {
    ServingState.LOADING: "its adapter is being loaded on {engine}: retry in a few seconds",
    ServingState.SERVED: "it is served on {engine}, whose node is not live now: retry "
    "when the node is back (`lorafleet top`), or serve it elsewhere (`lorafleet serve JOB`)",
    ServingState.REFUSED: "{engine} refused it: {reason}; {lift} would let it load",
    ServingState.RESTART_REQUIRED: "{engine} takes it at its next start, with {lift}",
    ServingState.FAILED: "loading it on {engine} failed: {reason}; `lorafleet serve JOB` "
    "tries again",
    ServingState.UNLOADED: "it was unloaded from {engine} ({reason}): `lorafleet serve JOB` "
    "serves it again",
}


def unserved_hint(records: Iterable[ServingRecord]) -> str | None:
    """Why a fine-tuned model has no location, from its job's serving records
    (any state); None when it has none (never asked to be served yet)."""
    newest_first = sorted(records, key=lambda r: r.updated_at, reverse=True)
    loading = [r for r in newest_first if r.state is ServingState.LOADING]
    told = next(iter(loading or newest_first), None)  # a load under way beats an old refusal
    if told is None:
        return None
    return _UNSERVED_HINTS[told.state].format(
        engine=told.engine, reason=told.reason or "no reason given", lift=told.lift or "a change"
    )


class FleetModelLocator:
    """`ModelLocator` from the serving records and heartbeats, through `client`."""

    def __init__(self, client: Client, api_key: str | None, ttl_s: float) -> None:
        self.client = client
        self.api_key = api_key
        self.ttl_s = ttl_s
        self._view = FleetView()
        self._asked_at: float | None = None
        self._lock = asyncio.Lock()
        self._renewal: asyncio.Task[None] | None = None
        #: Nodes whose heartbeat key went (deleted or expired) and that have
        #: not beaten since: left out of every view, whatever the scheduler says.
        self._gone: set[str] = set()

    def node_gone(self, node: str) -> None:
        """`node`'s heartbeat expired or its agent stopped: out of the routes
        now, not at the view's renewal (the gateway's watch of the nodes bucket)."""
        self._gone.add(node)
        self._view.without_node(node)

    def node_beat(self, node: str) -> None:
        """`node` beat: routes to it may come back at the next renewal."""
        self._gone.discard(node)

    def _live(self, nodes: list[NodeInfo]) -> list[NodeInfo]:
        return [n for n in nodes if n.heartbeat.node not in self._gone]

    async def where(self, model: str) -> list[ModelLocation]:
        locations = locations_in(await self._fresh(), model)
        return locations or locations_in(await self._refresh(), model)

    async def served(self) -> dict[str, list[ModelLocation]]:
        """The catalog bases served now (fine-tuned names need their suffix,
        which the gateway's job fields hold: list_models makes those)."""
        return dict((await self._fresh()).by_base)

    def forget(self, model: str, location: ModelLocation) -> None:
        tuned = fine_tuned_parts(model)
        if tuned is None:
            without(self._view.by_base, model, location)
        else:
            without(self._view.by_job, tuned[1], location)

    async def _fresh(self) -> FleetView:
        """The view; past its TTL it is still answered with while a new one is
        made beside the request (three requests inline would be the p99 of
        every completion that met them: bench/gateway_routing.py)."""
        if self._asked_at is None:
            return await self._refresh()
        if time.monotonic() - self._asked_at >= self.ttl_s and self._renewal is None:
            self._renewal = asyncio.create_task(self._renew())
        return self._view

    async def _renew(self) -> None:
        try:
            await self._refresh()
        except Exception as e:  # the old view stands; the next request tries again
            log.get().warning(log.Event.REQUEST_FAILED, message="fleet locations", error=repr(e))
        finally:
            self._renewal = None

    async def _refresh(self) -> FleetView:
        async with self._lock:
            records, nodes, catalog = await asyncio.gather(
                served_records(self.client),
                self.client.nodes(),
                self.client.models(),
            )
            self._view = fleet_view(records, self._live(nodes.nodes), catalog, self.api_key)
            self._asked_at = time.monotonic()
            return self._view


async def served_records(client: Client) -> list[ServingRecord]:
    """Every record in state served, page after page (at most MAX_SERVED_PAGES)."""
    out: list[ServingRecord] = []
    after = AdapterKey(job_id="", node="", engine="")  # from the start, in key order
    for _ in range(MAX_SERVED_PAGES):
        page = await client.adapters(state=ServingState.SERVED, limit=LIST_MAX, after=after)
        out.extend(page)
        if len(page) < LIST_MAX:
            return out
        after = AdapterKey(job_id=page[-1].job_id, node=page[-1].node, engine=page[-1].engine)
    log.get().warning(
        log.Event.LISTING_CAPPED, message=f"fleet locations: more than {len(out)} adapters "
        "served; the view holds that many",
    )  # fmt: skip
    return out


class ConfiguredFirstLocator:
    """`first` (the configured engines) where it serves the model, else `then`.

    `first`'s list as last read is looked at before `then`, and asked again
    only when `then` has no location either: a model the fleet serves costs no
    request to the configured engines (which a miss in their list would
    make every time), one they just loaded is still found."""

    def __init__(self, first: ModelLocator, then: ModelLocator) -> None:
        self.first = first
        self.then = then

    async def where(self, model: str) -> list[ModelLocation]:
        listed = (await self.first.served()).get(model)
        if listed:
            return listed
        return await self.then.where(model) or await self.first.where(model)

    async def served(self) -> dict[str, list[ModelLocation]]:
        mine, theirs = await asyncio.gather(self.first.served(), self.then.served())
        return {**theirs, **mine}

    def forget(self, model: str, location: ModelLocation) -> None:
        self.first.forget(model, location)
        self.then.forget(model, location)
