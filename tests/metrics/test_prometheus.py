"""The dashboard proven against a real Prometheus scraping every process.

The stack (recorder on PostgreSQL, scheduler, artifact-store, an agent with
the stand-in trainer, and a pretend GPU node heartbeating two cards: this
machine has no card) runs a real job; Prometheus scrapes each /metrics
every 0.5 s. Then every PromQL expression of every Prometheus panel of
compose/grafana/dashboards/lorafleet.json must return data over the test's
time range, with the labels its legend and `by (...)` use; every endpoint
passes `promtool check metrics`; and the values are the system's own: job
counts as the recorder's database holds them, the last loss as the job's
final loss, free card memory as the heartbeat carried it.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import shutil
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from lorafleet_schemas.messages import JobList, JobRecord, JobState
from lorafleet_trainer.memory import MIB
from tests.metrics.endpoints import host_port, metrics_url, scrape, series
from tests.metrics.prom import Prometheus
from tests.system.conftest import Stack

DASHBOARD = Path(__file__).resolve().parents[2] / "compose/grafana/dashboards/lorafleet.json"
#: The pretend GPU node's cards: (total MiB, free MiB).
CARDS = [(81559, 70000), (81559, 12000)]
#: Seconds a finished job's series stay (the default is 60): longer than a
#: scrape interval, so Prometheus sees the final values.
LINGER_S = 2.0
#: What Grafana puts in for `$__rate_interval` and `$__interval` here.
RATE_INTERVAL = "1m"
#: Stand-in steps and seconds per step: long enough for a few scrapes mid-job.
STEPS, STEP_S = 6, 0.15


@pytest.fixture
def stack_settings() -> dict[str, Any]:
    return {"metrics_addr": "127.0.0.1:0", "metrics_linger_s": LINGER_S}


def prometheus_targets(dashboard: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(panel title, target) of every Prometheus target of the dashboard."""
    return [
        (p["title"], t)
        for p in dashboard["panels"]
        for t in p["targets"]
        if (t.get("datasource") or p["datasource"])["type"] == "prometheus"
    ]


def labels_used(target: dict[str, Any]) -> set[str]:
    """The labels a target's legend and outermost `by (...)` name."""
    used = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))
    outer = re.match(r"^\s*\w+\s+by\s*\(([^)]*)\)", target["expr"])
    if outer:
        used |= {label.strip() for label in outer.group(1).split(",") if label.strip()}
    return used - {"le"}


def grafana_expr(expr: str, job_id: str) -> str:
    return (
        expr.replace("$__rate_interval", RATE_INTERVAL)
        .replace("$__interval", RATE_INTERVAL)
        .replace("$job_id", re.escape(job_id))
    )


@pytest.fixture
async def running(stack: Stack, tmp_path: Path) -> AsyncIterator[tuple[Stack, Prometheus]]:
    """The stack with an agent and a pretend GPU node, scraped by Prometheus."""
    await stack.agent(
        "node-1",
        env={"LORAFLEET_STANDIN_STEPS": str(STEPS), "LORAFLEET_STANDIN_STEP_S": str(STEP_S)},
    )
    stop = asyncio.Event()
    fake = asyncio.create_task(stack.fake_node("gpu-fake", CARDS, stop))
    procs = {
        "recorder": stack.recorder,
        "scheduler": stack.schedulers[0],
        "agent": stack.agents["node-1"],
    }
    if stack.artifact_store is not None:
        procs["artifact-store"] = stack.artifact_store
    targets = {name: host_port(metrics_url(p)) for name, p in procs.items()}
    try:
        async with Prometheus(tmp_path / "prometheus", targets) as prom:
            # Prometheus waits a few seconds before its first scrapes.
            await prom.wait_scrapes_after({}, more=2)
            yield stack, prom
    finally:
        stop.set()
        await fake


#: Rounds of two more scrapes a panel's query gets before it counts as empty.
EMPTY_RETRIES = 3


async def db_counts(stack: Stack) -> dict[str, int]:
    reply = await stack.call(stack.settings.names.jobs_list, {"limit": 1000})
    counts: dict[str, int] = {}
    for job in msgspec.convert(reply, JobList).jobs:
        counts[job.state.value] = counts.get(job.state.value, 0) + 1
    return counts


async def run_job(stack: Stack, prom: Prometheus) -> JobRecord:
    await stack.add_model()
    job = await stack.submit("node-1")
    done = await stack.wait_state(job.id, JobState.DONE, JobState.FAILED)
    assert done.state is JobState.DONE, done.message
    # Two scrapes of every target after the end: every series holds its final value.
    await prom.wait_scrapes_after(await prom.scrapes(), more=2)
    return done


async def test_the_dashboard_against_a_real_prometheus(
    running: tuple[Stack, Prometheus],
) -> None:
    """One job, then three checks (one scenario: Prometheus takes seconds to start)."""
    stack, prom = running
    start = time.time()
    job = await run_job(stack, prom)
    await every_panel_returns_data_with_its_labels(prom, job, start)
    await values_are_the_systems_own(stack, prom, job)
    await promtool_accepts_every_endpoint(prom)


async def every_panel_returns_data_with_its_labels(
    prom: Prometheus, job: JobRecord, start: float
) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    targets = prometheus_targets(dashboard)
    assert len(targets) >= 20, "the dashboard lost its Prometheus panels"
    empty: list[str] = []
    for title, target in targets:
        expr = grafana_expr(target["expr"], job.id)
        finite: list[dict[str, Any]] = []
        # A loaded machine scrapes late: up to EMPTY_RETRIES more rounds of
        # scrapes before a panel counts as empty.
        for _ in range(EMPTY_RETRIES + 1):
            result = await prom.query_range(expr, start, time.time(), 1.0)
            finite = [r for r in result if any(math.isfinite(float(v)) for _, v in r["values"])]
            if finite:
                break
            await prom.wait_scrapes_after(await prom.scrapes(), more=2)
        if not finite:
            empty.append(f"{title}: {expr}")
            continue
        for r in finite:
            missing = labels_used(target) - set(r["metric"])
            assert not missing, f"{title}: {expr} returned series without {missing}: {r['metric']}"
    assert not empty, "panels whose query returns nothing:\n" + "\n".join(empty)
    # The job variable lists the job.
    values = await prom.api("label/job_id/values", **{"match[]": "lorafleet_job_step"})
    assert job.id in values


async def values_are_the_systems_own(stack: Stack, prom: Prometheus, job: JobRecord) -> None:
    counts = await db_counts(stack)
    for state in JobState:
        got = await prom.value(f'lorafleet_jobs{{state="{state.value}"}}')
        assert got == counts.get(state.value, 0), f"jobs {state.value}: {got} vs {counts}"
    assert await prom.value("lorafleet_jobs_submitted_total") == sum(counts.values())
    assert await prom.value('lorafleet_jobs_finished_total{state="done"}') == 1
    assert await prom.value("lorafleet_job_start_latency_seconds_count") == 1
    last = f'last_over_time({{__name__=~"NAME", job_id="{job.id}"}}[10m])'
    assert job.loss is not None and job.eval_loss is not None
    assert await prom.value(last.replace("NAME", "lorafleet_job_loss")) == pytest.approx(
        job.loss, rel=1e-12
    )
    assert await prom.value(last.replace("NAME", "lorafleet_job_eval_loss")) == pytest.approx(
        job.eval_loss, rel=1e-12
    )
    assert await prom.value(last.replace("NAME", "lorafleet_job_step")) == job.steps == STEPS
    assert (
        await prom.value(last.replace("NAME", "lorafleet_job_peak_memory_bytes"))
        == job.peak_mib * MIB
    )
    for index, (total, free) in enumerate(CARDS):
        card = f'node="gpu-fake", card="{index}"'
        assert await prom.value(f"lorafleet_card_memory_free_bytes{{{card}}}") == free * MIB
        assert await prom.value(f"lorafleet_card_memory_total_bytes{{{card}}}") == total * MIB
    stored = await prom.value('sum(lorafleet_artifacts_stored_total{kind="peft"})')
    assert stored == 1
    applied = await prom.value("lorafleet_status_reports_applied_total")
    assert applied is not None and applied >= STEPS


async def promtool_accepts_every_endpoint(prom: Prometheus) -> None:
    assert shutil.which("promtool"), "promtool is missing: apt-get install prometheus (./dev does)"
    for service, addr in prom.targets.items():
        text = await scrape(f"http://{addr}/metrics")
        assert series(text, "lorafleet_"), f"{service} serves no lorafleet series"
        out = await asyncio.to_thread(
            subprocess.run,
            ["promtool", "check", "metrics"],
            input=text.encode(),
            capture_output=True,
        )
        assert out.returncode == 0, f"{service}: " + (out.stdout + out.stderr).decode()
