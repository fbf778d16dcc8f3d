"""An engine restarted with several adapters loaded: the serving agent (in
this process, on a real nats-server) loads every one it lost again, several
in flight at once, and the placement's asks for them join that reload. The
engine is tests/gateway/engine.py (vLLM's interface; its control file makes
each load and completion slow, as a loaded engine's are), killed and
started again on its port."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import httpx2

from lorafleet_schemas.messages import (
    Engine,
    ModelRecord,
    NodeServeRequest,
    ServingState,
)
from lorafleet_services.agent.config import AgentConfig
from lorafleet_services.agent.serving import agent as serving_agent
from lorafleet_services.agent.serving.agent import ServingAgent
from lorafleet_services.agent.serving.orders import ServeOrder
from tests.agent.conftest import Bus
from tests.agent.serving_in_process import StandinEngine, running_serving_agent, staged_adapter
from tests.eventually import eventually
from tests.serving_reports import ServingReports, of
from tests.vllm_server import free_port

#: Adapters the engine holds when it restarts: more than RELOAD_CONCURRENCY.
ADAPTERS = 6
#: Seconds each load and each probe completion takes on the restarted engine.
SLOW_S = 0.5
#: Seconds a report may take (loads of SLOW_S, a loaded machine).
REPORT_TIMEOUT_S = 60.0


async def _restarted_with_adapters(
    fleet: Bus, tmp_path: Path, refresh_s: float, ask_again: bool
) -> None:
    """ADAPTERS served, the engine restarted slow: the reports that follow
    (2 * ADAPTERS: each loading, then served or failed), checked to be the
    reload's; with `ask_again`, each lost version asked for as the placement
    asks (`placed`) before the watch's own read sees the restart."""
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps({"model_type": "llama"}))
    control = tmp_path / "engine-control.json"
    engine = StandinEngine(base, free_port(), control, max_loras=2 * ADAPTERS)
    await engine.start()
    cfg = AgentConfig(
        node="node-1", work_dir=tmp_path / "agent", trainer="standin",
        vllm_servers=(engine.url,), engines_refresh_s=refresh_s,
    )  # fmt: skip
    model = ModelRecord(
        name="tiny", engine=Engine.VLLM, hf_repo=None, hf_revision="main",
        local_dir=str(base), description="", created_at=dt.datetime.now(dt.UTC),
    )  # fmt: skip
    names = fleet.settings.names
    reports = await ServingReports.of_node(fleet.js, names, "node-1")
    try:
        async with running_serving_agent(fleet.js, names, cfg) as agent:
            jobs = {f"job-{i}": staged_adapter(tmp_path / "trained", f"job-{i}")[1]
                    for i in range(ADAPTERS)}  # fmt: skip
            for job, sha in jobs.items():
                agent.auto_serve(ServeOrder(job_id=job, model=model, sha256=sha,
                                            probe_base=str(base),
                                            adapter_dir=tmp_path / "trained" / job))  # fmt: skip
                await agent.idle()
            served = [
                await reports.next(of(job, ServingState.SERVED), REPORT_TIMEOUT_S) for job in jobs
            ]
            names_served = {r.served_name for r in served}

            control.write_text(json.dumps({"delay_s": SLOW_S}))
            await engine.kill()
            await engine.start()
            if ask_again:
                # The beat that shows the engine back, read before the serving
                # side acts on it: the placement asks then (a read in flight
                # while the engine was down would else leave it unmatched).
                agent.watch.on_read, on_read = None, agent.watch.on_read
                await agent.watch.refresh()
                agent.watch.on_read = on_read
                for job, sha in jobs.items():
                    req = NodeServeRequest(job_id=job, model=model, object="", sha256=sha,
                                           placed=True)  # fmt: skip
                    reply = await agent.serve_request(req)
                    assert reply.engines == [engine.url], reply
            again = [
                await reports.next(
                    lambda r: (
                        r.served_name in names_served
                        and r.state
                        in (ServingState.LOADING, ServingState.SERVED, ServingState.FAILED)
                    ),
                    REPORT_TIMEOUT_S,
                )
                for _ in range(2 * ADAPTERS)
            ]
            assert [r.state for r in again].count(ServingState.SERVED) == ADAPTERS, again
            assert {r.served_name for r in again if r.state is ServingState.SERVED} == names_served
            # Several in flight: as many loads begun as the width allows before one ends.
            first_served = [r.state for r in again].index(ServingState.SERVED)
            width = min(ADAPTERS, serving_agent.RELOAD_CONCURRENCY)
            assert first_served == width > 1, [r.state for r in again]
            assert all(r.reason.endswith("lost it (restarted?): loading it again")
                       for r in again[:first_served])  # fmt: skip
            await eventually(lambda: _listed(engine.url), "every adapter on the engine",
                             until=names_served.__eq__)  # fmt: skip
            _placed_as_asked(agent, engine.url, ask_again)
    finally:
        await engine.kill()


async def _listed(url: str) -> set[str]:
    async with httpx2.AsyncClient() as http:
        reply = await http.get(f"{url}/v1/models", timeout=5.0)
    return {m["id"] for m in reply.json()["data"] if m.get("parent")}


def _placed_as_asked(agent: ServingAgent, url: str, asked: bool) -> None:
    """An ask with `placed` marks the version placed (never evicted) as a load would."""
    assert [a.placed for a in agent.desired.on(url)] == [asked] * ADAPTERS


async def test_an_engine_restarted_gets_every_adapter_back_several_at_once(
    fleet: Bus, tmp_path: Path
) -> None:
    await _restarted_with_adapters(fleet, tmp_path, refresh_s=0.5, ask_again=False)


async def test_the_placements_asks_after_a_restart_join_the_reload(
    fleet: Bus, tmp_path: Path
) -> None:
    """Asked for versions it should hold (the placement after an engine
    restart, hundreds at once in nemesis seed 44), the agent reads the
    engine and reloads them together, not one ask at a time behind its
    lock: the watch's own read is 60 s away, so only the asks start it."""
    await _restarted_with_adapters(fleet, tmp_path, refresh_s=60.0, ask_again=True)
