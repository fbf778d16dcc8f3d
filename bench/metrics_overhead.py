"""What Prometheus metrics cost the hot paths: metrics on against off, in one script.

    .venv/bin/python bench/metrics_overhead.py [--reports 20000] [--nodes 100]
                                               [--jobs 200] [--rounds 3]

Two hot paths, each measured in three modes, alternately, for a few rounds
(the best run of each counts: this machine is shared, and the slowest runs
are the noise):

1. status reports persisted per second by one in-process recorder on
   PostgreSQL (bench/recorder_reports.py's measurement);
2. submit-to-start latency (p99) with `--nodes` simulated idle nodes
   heartbeating (bench/scheduler_dispatch.py's trial: submit, wait for the
   start request at the node, cancel), recorder and scheduler as processes.

"off" is the code without metrics: every prometheus_client update
(inc, set, observe, labels) and the agent-side job table are replaced by
no-ops (in this process, and through a sitecustomize.py on the children's
PYTHONPATH), and no endpoint is served. "counting" is the code as shipped
with no endpoint (the default: LORAFLEET_METRICS_ADDR unset). "on" is the
code as shipped, every process serving /metrics on a free port and scraped
once a second (15 times Prometheus's default pace) by a real Prometheus
(tests/metrics/prom.py) while it measures. Target: on within 5% of off on
both. Last, the unit costs behind them, measured in this process: one
request's metric updates and one scrape of a scheduler's endpoint, each
as a fraction of the median dispatch measured above.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from lorafleet import log
from lorafleet.nats.server import NatsServer
from lorafleet.settings import Settings
from recorder_reports import make_jobs, make_reports, publish, recorder_rate
from scheduler_common import StartTimes, bench_stack, percentile, recording_fleet, summary

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.pg
import contextlib

from tests.metrics.prom import Prometheus
from tests.pg import throwaway_database

#: Seconds between two scrapes of every endpoint while "on" is measured.
SCRAPE_S = 1.0
#: "off": no metric updates, no endpoint; "counting": updates, no endpoint;
#: "on": updates, every process serving and a real Prometheus scraping.
MODES = ("off", "counting", "on")
#: Dispatch trials run first and not counted.
WARMUP = 10

#: Turns every metric update into a no-op (run in this process, and as the
#: children's sitecustomize.py).
STUB = """
import prometheus_client.metrics as _m

def _noop(self, *args, **kwargs):
    return None

def _self(self, *args, **kwargs):
    return self

for _cls, _names in ((_m.Counter, ("inc",)), (_m.Gauge, ("inc", "dec", "set")),
                     (_m.Histogram, ("observe",))):
    for _name in _names:
        setattr(_cls, _name, _noop)
_m.MetricWrapperBase.labels = _self

import lorafleet_services.agent.metric_views as _views
_views.RunningJobs.report = _noop
"""


class Metrics:
    """Metrics on or off, for this process and the children it starts."""

    def __init__(self, tmp: str) -> None:
        self.stub_dir = Path(tmp) / "metrics-off"
        self.stub_dir.mkdir()
        (self.stub_dir / "sitecustomize.py").write_text(STUB)
        self.saved: dict[Any, dict[str, Any]] = {}
        self.pythonpath = os.environ.get("PYTHONPATH", "")

    def off(self) -> None:
        import prometheus_client.metrics as m

        from lorafleet_services.agent.metric_views import RunningJobs

        for cls in (m.Counter, m.Gauge, m.Histogram, m.MetricWrapperBase, RunningJobs):
            self.saved.setdefault(cls, dict(vars(cls)))
        exec(STUB, {})
        os.environ["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(self.stub_dir), self.pythonpath])
        )

    def on(self) -> None:
        for cls, attrs in self.saved.items():
            for name in ("inc", "dec", "set", "observe", "labels", "report"):
                if name in attrs:
                    setattr(cls, name, attrs[name])
        os.environ["PYTHONPATH"] = self.pythonpath


@contextlib.asynccontextmanager
async def scraped(tmp: str, urls: list[str]) -> AsyncIterator[Prometheus]:
    """A real Prometheus scraping `urls` every SCRAPE_S seconds (its own process)."""
    targets = {f"p{i}": urlparse(u).netloc for i, u in enumerate(urls)}
    async with Prometheus(Path(tmp) / f"prom-{time.monotonic_ns()}", targets, SCRAPE_S) as prom:
        # Its first scrapes come a few seconds after start: measure once it scrapes.
        await prom.wait_scrapes_after({}, more=1)
        yield prom


async def reports_per_s(tmp: str, total: int, jobs: int, mode: str) -> float:
    """Reports/s of one in-process recorder (served and scraped when "on")."""
    from lorafleet import metrics
    from lorafleet._metrics_http import MetricsServer

    with throwaway_database("lorafleet_bench") as url:
        async with NatsServer(f"{tmp}/nats-{time.monotonic_ns()}") as server:
            settings = Settings(nats_url=server.url, database_url=url, data_dir=tmp)
            job_ids = await make_jobs(url, jobs)
            await publish(settings, make_reports(job_ids, total))
            if mode != "on":
                return await recorder_rate(settings, total)
            metrics.register("recorder")
            endpoint = MetricsServer("127.0.0.1:0")
            await endpoint.start()
            try:
                async with scraped(tmp, [endpoint.url]):
                    return await recorder_rate(settings, total)
            finally:
                await endpoint.stop()


async def start_latencies(tmp: str, nodes: int, jobs: int, mode: str) -> list[float]:
    """Submit -> start request received, in seconds, for `jobs` trials."""
    async with bench_stack(metrics_addr="127.0.0.1:0" if mode == "on" else "") as stack:
        await stack.add_model()
        async with recording_fleet(stack, nodes) as (fleet, times):
            if mode != "on":
                return await run_trials(stack, list(fleet.nodes), jobs, times)
            procs = (stack.recorder, stack.scheduler)
            async with scraped(tmp, [p.events("service.started")[-1]["metrics"] for p in procs]):
                return await run_trials(stack, list(fleet.nodes), jobs, times)


async def run_trials(stack: Any, names: list[str], jobs: int, times: StartTimes) -> list[float]:
    rng = random.Random(7)
    latencies: list[float] = []
    for i in range(WARMUP + jobs):
        node = rng.choice(names) if i % 2 == 0 else None
        t0 = time.perf_counter()
        job_id = await stack.submit(node)
        started = await times.of(job_id)
        if i >= WARMUP:
            latencies.append(started - t0)
        await stack.call(stack.settings.names.jobs_cancel, {"id": job_id})
        await asyncio.sleep(0.02)
    return latencies


async def alternate(
    metrics: Metrics, rounds: int, measure: Callable[[str], Coroutine[Any, Any, Any]]
) -> dict[str, list[Any]]:
    """Each mode once per round, the order reversed every other round."""
    runs: dict[str, list[Any]] = {mode: [] for mode in MODES}
    for i in range(rounds):
        for mode in MODES if i % 2 == 0 else MODES[::-1]:
            metrics.off() if mode == "off" else metrics.on()
            runs[mode].append(await measure(mode))
    metrics.on()
    return runs


def report_rates(rates: dict[str, list[float]], total: int) -> None:
    best = {mode: max(runs) for mode, runs in rates.items()}
    print(f"status reports persisted ({total} reports, PostgreSQL, best of {len(rates['off'])}):")
    for mode in MODES:
        runs = ", ".join(f"{r:,.0f}" for r in rates[mode])
        print(f"  {mode:<8} {best[mode]:>8,.0f} reports/s   (runs: {runs})")
    ratio = best["on"] / best["off"]
    print(f"  on / off: {ratio:.3f}   target >= 0.95: {'met' if ratio >= 0.95 else 'NOT met'}")


def report_latencies(lat: dict[str, list[list[float]]], nodes: int) -> None:
    p99 = {mode: min(percentile(trials, 99) for trials in runs) for mode, runs in lat.items()}
    med = {
        mode: statistics.median(statistics.median(t) for t in runs) for mode, runs in lat.items()
    }
    print(f"submit-to-start ({nodes} nodes heartbeating; best p99 and median of medians):")
    for mode in MODES:
        best = min(lat[mode], key=lambda trials: percentile(trials, 99))
        print(f"  {mode:<8} {summary(best)}   median of medians {med[mode] * 1000:.1f} ms")
    ratio = p99["on"] / p99["off"]
    print(f"  p99 on / off: {ratio:.3f}   target <= 1.05: {'met' if ratio <= 1.05 else 'NOT met'}")
    print(f"  median on / off: {med['on'] / med['off']:.3f}; counting / off: "
          f"{med['counting'] / med['off']:.3f}")  # fmt: skip


def unit_costs(nodes: int) -> tuple[float, float]:
    """(seconds per request's metric updates, seconds per scrape of a
    scheduler knowing `nodes` nodes with two cards each), in this process."""
    import datetime as dt

    from lorafleet import metrics
    from lorafleet._metrics_http import exposition
    from lorafleet_schemas.messages import Card, Heartbeat
    from lorafleet_services.scheduler.metric_views import node_samples

    metrics.register("scheduler")
    endpoint = "lorafleet.bench.endpoint"
    metrics.endpoint_metrics(endpoint)
    requests, duration = (
        metrics.API_REQUESTS.labels(endpoint),
        metrics.API_DURATION.labels(endpoint),
    )
    n = 100_000
    t0 = time.perf_counter()
    for _ in range(n):
        requests.inc()
        duration.observe(0.003)
    per_update = (time.perf_counter() - t0) / n
    now = dt.datetime.now(dt.UTC)
    cards = [Card(index=i, name="H100", total_mib=81559, free_mib=70000) for i in range(2)]
    beats = [
        Heartbeat(node=f"n{i}", version="1", started_at=now, time=now, cards=cards)
        for i in range(nodes)
    ]
    remove = metrics.LIVE.add(lambda: node_samples((b, True, 0.5) for b in beats))
    scrapes = 50
    t0 = time.perf_counter()
    for _ in range(scrapes):
        exposition()
    per_scrape = (time.perf_counter() - t0) / scrapes
    remove()
    return per_update, per_scrape


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reports", type=int, default=20_000)
    ap.add_argument("--report-jobs", type=int, default=4)
    ap.add_argument("--nodes", type=int, default=100)
    ap.add_argument("--jobs", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    log.configure("bench", "error")
    total = args.reports // args.report_jobs * args.report_jobs
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Metrics(tmp)
        rates = await alternate(
            metrics, args.rounds, lambda mode: reports_per_s(tmp, total, args.report_jobs, mode)
        )
        lat = await alternate(
            metrics, args.rounds, lambda mode: start_latencies(tmp, args.nodes, args.jobs, mode)
        )
    report_rates(rates, total)
    report_latencies(lat, args.nodes)
    per_update, per_scrape = unit_costs(args.nodes)
    dispatch_s = statistics.median(statistics.median(t) for t in lat["off"])
    print("unit costs (this process), against the median submit-to-start with metrics off:")
    print(f"  one request's updates (counter + histogram): {per_update * 1e6:.1f} us "
          f"= {per_update / dispatch_s:.5f} of a dispatch")  # fmt: skip
    print(f"  one scrape of a scheduler with {args.nodes} nodes: {per_scrape * 1000:.1f} ms "
          f"= {per_scrape / dispatch_s:.2f} dispatches; at a 15 s scrape interval "
          f"{per_scrape / 15:.2%} of the scheduler's loop")  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())
