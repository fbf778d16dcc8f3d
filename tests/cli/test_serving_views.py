"""What `lorafleet adapters`, `serve`/`unserve` and `top` print about serving,
without a bus: the tables are plain functions of the records and heartbeats."""

from __future__ import annotations

import datetime as dt

import msgspec
from rich.console import Console

from lorafleet_schemas.messages import (
    Engine,
    EngineRef,
    Heartbeat,
    NodeInfo,
    NodeServeReply,
    ServingRecord,
    ServingState,
)
from lorafleet_services.cli.serving import adapters_table, reply_line
from lorafleet_services.cli.top import FleetSnapshot, fleet_view

T0 = dt.datetime(2026, 1, 1, 12, 0, tzinfo=dt.UTC)


def shown(renderable: object) -> str:
    console = Console(width=200, record=True, color_system=None)
    console.print(renderable)
    return console.export_text()


def record(**changes: object) -> ServingRecord:
    base = ServingRecord(
        job_id="j1", node="gpu-1", engine="http://127.0.0.1:8000", engine_kind=Engine.VLLM,
        model="tiny", served_name="j1-abcdef012345", sha256="a" * 64, state=ServingState.SERVED,
        probe_error=0.0021, created_at=T0, updated_at=T0, version=2,
    )  # fmt: skip
    return msgspec.structs.replace(base, **changes)


def test_the_adapters_table_says_where_why_and_what_lifts_it() -> None:
    refused = record(
        job_id="j2", state=ServingState.REFUSED, probe_error=None,
        reason="rank 32 is over the engine's --max-lora-rank 16", lift="--max-lora-rank 32",
        updated_at=T0 - dt.timedelta(seconds=30),
    )  # fmt: skip
    text = shown(adapters_table([record(), refused], T0 + dt.timedelta(seconds=5)))
    assert "adapters (2)" in text
    for column in ("job", "node", "engine", "served name", "state", "reason / lift", "probe"):
        assert column in text, text
    served_row = next(line for line in text.splitlines() if "j1 " in line)
    for part in ("gpu-1", "http://127.0.0.1:8000", "j1-abcdef012345", "served", "0.0021", "5s ago"):
        assert part in served_row, served_row
    assert "rank 32 is over the engine's --max-lora-rank 16" in text
    assert "lift: --max-lora-rank 32" in text and "35s ago" in text


def test_serve_and_unserve_say_what_each_node_took_on() -> None:
    took = NodeServeReply(engines=["http://a:1", "http://b:2"], node="gpu-1")
    assert (
        reply_line("j1", "loads into", took) == "j1: node gpu-1 loads into http://a:1, http://b:2"
    )
    none = NodeServeReply(node="gpu-2", reason="no engine on gpu-2 serves model tiny")
    assert reply_line("j1", "loads into", none) == (
        "j1: node gpu-2 loads into nothing: no engine on gpu-2 serves model tiny"
    )


def test_top_shows_each_live_nodes_engines_and_their_adapters() -> None:
    def info(node: str, alive: bool, engines: list[EngineRef]) -> NodeInfo:
        hb = Heartbeat(node=node, version="1", started_at=T0, time=T0, serving=engines)
        return NodeInfo(heartbeat=hb, alive=alive)

    vllm = EngineRef(
        kind=Engine.VLLM, url="http://127.0.0.1:8000", model="tiny", max_loras=2,
        adapters=["j1-abcdef012345"],
    )  # fmt: skip
    idle = EngineRef(kind=Engine.LLAMACPP, url="http://127.0.0.1:8080", model=None)
    busy = EngineRef(kind=Engine.VLLM, url="http://127.0.0.1:8001", model="tiny",
                     adapters=["j2-1"], answered=False)  # fmt: skip
    gone = EngineRef(kind=Engine.VLLM, url="http://10.0.0.9:8000", adapters=["old-1"])
    snap = FleetSnapshot(
        nodes=[info("gpu-1", True, [vllm, idle, busy]), info("gpu-2", False, [gone])],
        running=[], queued=[], taken_at=T0,
    )  # fmt: skip
    text = shown(fleet_view(snap))
    assert "engines (3)" in text, text
    row = next(line for line in text.splitlines() if "127.0.0.1:8000" in line)
    for part in ("gpu-1", "vllm", "tiny", "j1-abcdef012345 (1/2)"):
        assert part in row, row
    llama = next(line for line in text.splitlines() if "127.0.0.1:8080" in line)
    assert "llamacpp" in llama and "none" in llama and "?" in llama
    assert "old-1" not in text  # a lost node's engines say nothing about now
    silent = next(line for line in text.splitlines() if "127.0.0.1:8001" in line)
    assert "not answering; last listed: j2-1" in silent, silent
