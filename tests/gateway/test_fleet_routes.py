"""Where the gateway sends a model, as the serving records and heartbeats say,
without a bus: `fleet_view` and `locations_in` are plain functions."""

from __future__ import annotations

import datetime as dt
from typing import Any, cast

import msgspec
import pytest
from structlog.testing import capture_logs

from lorafleet.client import Client
from lorafleet.log import Event
from lorafleet_schemas.messages import (
    AdapterKey,
    Engine,
    EngineRef,
    Heartbeat,
    ModelRecord,
    NodeInfo,
    ServingRecord,
    ServingState,
)
from lorafleet_services.gateway import fleet_model_location
from lorafleet_services.gateway.fleet_model_location import (
    ConfiguredFirstLocator,
    engine_base_url,
    fleet_view,
    locations_in,
    served_records,
    unserved_hint,
)
from lorafleet_services.gateway.inference_routes import with_model
from lorafleet_services.gateway.job_mapping import fine_tuned_model_name, fine_tuned_parts
from lorafleet_services.gateway.model_location import ModelLocation

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
A, B = "http://10.0.0.1:8000", "http://10.0.0.2:8000/v1"


def node(name: str, engines: list[EngineRef], alive: bool = True) -> NodeInfo:
    hb = Heartbeat(node=name, version="1", started_at=T0, time=T0, serving=engines)
    return NodeInfo(heartbeat=hb, alive=alive)


def served(job: str, node_name: str, engine: str, state: ServingState) -> ServingRecord:
    return ServingRecord(
        job_id=job, node=node_name, engine=engine, engine_kind=Engine.VLLM, model="tiny",
        served_name=f"{job}-0123456789ab", sha256="a" * 64, state=state,
        created_at=T0, updated_at=T0,
    )  # fmt: skip


CATALOG = [
    ModelRecord(
        name="tiny",
        engine=Engine.VLLM,
        hf_repo=None,
        hf_revision="main",
        local_dir="/models/tiny",
        description="",
        created_at=T0,
    )
]


def test_a_fine_tuned_name_goes_to_each_live_engine_serving_its_job() -> None:
    nodes = [
        node("n1", [EngineRef(kind=Engine.VLLM, url=A, model="/models/tiny/")]),
        node("n2", [EngineRef(kind=Engine.VLLM, url=B, model="/models/other")]),
        node("n3", [EngineRef(kind=Engine.VLLM, url="http://10.0.0.3:8000")], alive=False),
    ]
    records = [
        served("j1", "n1", A, ServingState.SERVED),
        served("j1", "n2", B, ServingState.SERVED),
        served("j1", "n3", "http://10.0.0.3:8000", ServingState.SERVED),  # a lost node
        served("j2", "n1", A, ServingState.LOADING),
        served("j3", "n1", "http://gone:1", ServingState.SERVED),  # no longer run there
    ]
    view = fleet_view(records, nodes, CATALOG, api_key="k")
    j1 = locations_in(view, fine_tuned_model_name("tiny", "sums", "j1"))
    assert [(r.base_url, r.served_name, r.api_key) for r in j1] == [
        (f"{A}/v1", "j1-0123456789ab", "k"),
        (B, "j1-0123456789ab", "k"),
    ]
    for name in ("ft:tiny::j2", "ft:tiny:x:j3", "ft:other:sums:j1", "ft:tiny:sums:nope"):
        assert locations_in(view, name) == [], name
    # A base: the engines whose own model is the catalog entry (by its local_dir).
    [base] = locations_in(view, "tiny")
    assert (base.base_url, base.served_name) == (f"{A}/v1", "/models/tiny/")
    assert locations_in(view, "other") == []


def test_a_model_not_served_now_says_where_its_adapter_stands() -> None:
    assert unserved_hint([]) is None  # never asked: the generic message
    refused = msgspec.structs.replace(
        served("j1", "n1", A, ServingState.REFUSED),
        reason="rank 32 over the engine's --max-lora-rank 16", lift="--max-lora-rank 32",
    )  # fmt: skip
    assert unserved_hint([refused]) == (
        f"{A} refused it: rank 32 over the engine's --max-lora-rank 16; "
        "--max-lora-rank 32 would let it load"
    )
    # A load under way on another engine beats the newer refusal: retry soon.
    loading = msgspec.structs.replace(
        served("j1", "n2", B, ServingState.LOADING), updated_at=T0 - dt.timedelta(seconds=5)
    )
    assert unserved_hint([refused, loading]) == (
        f"its adapter is being loaded on {B}: retry in a few seconds"
    )
    gone = msgspec.structs.replace(
        served("j1", "n1", A, ServingState.UNLOADED), reason="unserved on request",
        updated_at=T0 + dt.timedelta(seconds=1),
    )  # fmt: skip
    hint = unserved_hint([refused, gone])
    assert hint is not None and hint.startswith(f"it was unloaded from {A} (unserved on request)")


def test_names_and_bodies() -> None:
    assert fine_tuned_parts("ft:tiny:sums:j1") == ("tiny", "j1")
    for suffix in ("sums", None, "a:b"):  # the name the gateway gives, taken apart again
        assert fine_tuned_parts(fine_tuned_model_name("tiny", suffix, "j1")) == ("tiny", "j1")
    assert fine_tuned_parts("ft:tiny::j1") == ("tiny", "j1")
    assert fine_tuned_parts("tiny") is None and fine_tuned_parts("ft:tiny:j1") is None
    assert engine_base_url("http://h:1/") == "http://h:1/v1" == engine_base_url("http://h:1/v1")
    body = b'{"model":"ft:tiny:sums:j1","messages":[{"role":"user","content":"hi"}],"n":1}'
    assert with_model(body, "j1-0123456789ab") == (
        b'{"model":"j1-0123456789ab","messages":[{"role":"user","content":"hi"}],"n":1}'
    )


class Listed:
    """A ModelLocator that counts its asks: `served` is its cached list, `where` asks anew."""

    def __init__(
        self, served: dict[str, list[ModelLocation]], fresh: dict[str, list[ModelLocation]]
    ):
        self._served, self._fresh, self.asked = served, fresh, 0

    async def where(self, model: str) -> list[ModelLocation]:
        self.asked += 1
        return self._fresh.get(model, [])

    async def served(self) -> dict[str, list[ModelLocation]]:
        return self._served


async def test_the_configured_engines_come_first_and_are_asked_only_after_the_fleet() -> None:
    env, fleet = ModelLocation("http://env/v1"), ModelLocation("http://fleet/v1", served_name="x")
    first = Listed({"tiny": [env]}, {"tiny": [env], "just-loaded": [env]})
    then = Listed({}, {"tiny": [fleet], "ft:tiny::j1": [fleet]})
    routes = ConfiguredFirstLocator(first, then)
    assert await routes.where("tiny") == [env]  # the override, from its list as read
    assert await routes.where("ft:tiny::j1") == [fleet]
    assert first.asked == 0  # a model the fleet serves asks the configured engines nothing
    assert await routes.where("just-loaded") == [env] and first.asked == 1
    assert await routes.where("nowhere") == []


async def test_the_view_reads_every_served_record_page_after_page(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past the recorder's cap of a page (here 3): before, the view held the
    newest 1,000 served records only, and an older adapter was a 404."""
    monkeypatch.setattr(fleet_model_location, "LIST_MAX", 3)
    records = sorted(
        (served(f"j{i}", f"n{k}", A, ServingState.SERVED) for i in range(4) for k in range(2)),
        key=lambda r: (r.job_id, r.node, r.engine),
    )

    class Recorder:
        async def adapters(self, **ask: Any) -> list[ServingRecord]:
            assert ask["state"] is ServingState.SERVED
            after: AdapterKey = ask["after"]
            past = [r for r in records if (r.job_id, r.node, r.engine) > (
                after.job_id, after.node, after.engine)]  # fmt: skip
            return past[: ask["limit"]]

    got = await served_records(cast(Client, Recorder()))
    assert [(r.job_id, r.node) for r in got] == [(r.job_id, r.node) for r in records]
    # Past its most pages the view goes on with what it read, and says so.
    monkeypatch.setattr(fleet_model_location, "MAX_SERVED_PAGES", 2)
    with capture_logs() as logs:
        got = await served_records(cast(Client, Recorder()))
    assert len(got) == 6
    assert [e["event"] for e in logs] == [Event.LISTING_CAPPED], logs
