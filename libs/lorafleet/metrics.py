"""Prometheus metrics of every lorafleet process, defined once.

Every metric is defined here, named the Prometheus way, and updated by one
call per event (`metrics.JOBS_SUBMITTED.inc()`). Importing this module
registers nothing: `register(service)`, at the service's start, puts that
service's metrics and the live gauges (`LIVE`, computed at each scrape by
the views each service adds) on prometheus_client's registry; the endpoint
is private (`lorafleet._metrics_http`). The labels and every metric:
docs/metrics.md; the rules for a new one: libs/lorafleet/DESIGN.md.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

import lorafleet.log as log
from lorafleet.log import Event
from lorafleet.states import FINAL
from lorafleet_schemas.messages import ArtifactKind, ErrorCode, JobState, StatusReport

#: Final states, in the order the finished counter is pre-set (zero series
#: exist before the first job ends, so a panel over them has data).
_FINAL = tuple(state for state in JobState if state in FINAL)

# --- every process ----------------------------------------------------------

BUILD_INFO = Gauge(
    "lorafleet_build_info",
    "1 for each running lorafleet process",
    ["service", "version"],
    registry=None,
)
API_REQUESTS = Counter(
    "lorafleet_api_requests",
    "Requests answered, by endpoint (NATS subject)",
    ["endpoint"],
    registry=None,
)
API_ERRORS = Counter(
    "lorafleet_api_errors",
    "Error replies, by endpoint and error code (bad_request, not_found, ...)",
    ["endpoint", "code"],
    registry=None,
)
API_DURATION = Histogram(
    "lorafleet_api_request_duration_seconds",
    "Seconds from a request's arrival to its reply, by endpoint",
    ["endpoint"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
    registry=None,
)

# --- recorder ---------------------------------------------------------------

JOBS_SUBMITTED = Counter("lorafleet_jobs_submitted", "Jobs accepted by the recorder", registry=None)
JOBS_FINISHED = Counter(
    "lorafleet_jobs_finished", "Jobs that reached a final state", ["state"], registry=None
)
STATUS_APPLIED = Counter(
    "lorafleet_status_reports_applied", "Status reports applied", registry=None
)
STATUS_REFUSED = Counter(
    "lorafleet_status_reports_refused",
    "Status reports refused (wrong node or attempt, final job)",
    registry=None,
)
STATUS_LAG = Histogram(
    "lorafleet_status_report_lag_seconds",
    "Seconds from a status report's time (the agent's clock) to its commit",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
    registry=None,
)

# --- scheduler --------------------------------------------------------------

JOB_START_LATENCY = Histogram(
    "lorafleet_job_start_latency_seconds",
    "Seconds from a job's submit to its start on a node (the agent accepted it)",
    buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600),
    registry=None,
)
JOBS_DISPATCHED = Counter(
    "lorafleet_jobs_dispatched", "Start requests a node accepted", registry=None
)
DISPATCH_ROUND = Histogram(
    "lorafleet_dispatch_round_duration_seconds",
    "Seconds one dispatch round takes (fail lost nodes' jobs, dispatch, reconcile)",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
    registry=None,
)
NODES_LOST = Counter(
    "lorafleet_nodes_lost",
    "Nodes whose heartbeat stopped (expired or silent)",
    ["reason"],
    registry=None,
)
NODES_LEFT = Counter("lorafleet_nodes_left", "Nodes whose agent stopped cleanly", registry=None)
#: The outcomes of `api.adapters.serve`/`unserve`: sent to the node and
#: answered, refused before sending (not done, no adapter, node not alive,
#: ...), or the node did not answer.
SERVE_OUTCOMES = ("sent", "refused", "unanswered")
SERVE_REQUESTS = Counter(
    "lorafleet_serve_requests",
    "adapters.serve and adapters.unserve requests the scheduler answered, by outcome",
    ["request", "outcome"],
    registry=None,
)

# --- agent ------------------------------------------------------------------

#: The causes of a paused trainer's seconds (agent/training/yielding.py).
YIELD_CAUSES = ("engine_busy", "idle_wait")
TRAINER_YIELD = Counter(
    "lorafleet_trainer_yield_seconds",
    "Seconds the agent held its trainer paused for the node's engines, by cause: "
    "engine_busy (an engine had requests), idle_wait (idle less than the node's yield_idle_s)",
    ["cause"],
    registry=None,
)

# --- artifact-store ---------------------------------------------------------

ARTIFACTS_STORED = Counter(
    "lorafleet_artifacts_stored", "Artifacts committed, by kind", ["kind"], registry=None
)
ARTIFACT_BYTES = Counter(
    "lorafleet_artifact_stored_bytes",
    "Bytes of committed artifacts, by kind",
    ["kind"],
    registry=None,
)
ARTIFACTS_REJECTED = Counter(
    "lorafleet_artifacts_rejected",
    "Deliveries refused (short, corrupt, not the node's job)",
    registry=None,
)
ARTIFACT_DELIVERY = Histogram(
    "lorafleet_artifact_delivery_duration_seconds",
    "Seconds from an artifact's first chunk seen to its commit, by kind",
    ["kind"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
    registry=None,
)


def _preset() -> None:
    """Series that exist at zero from the start: rate() and panels need them."""
    for state in _FINAL:
        JOBS_FINISHED.labels(state.value)
    for reason in ("expired", "silent"):
        NODES_LOST.labels(reason)
    for request in ("serve", "unserve"):
        for outcome in SERVE_OUTCOMES:
            SERVE_REQUESTS.labels(request, outcome)
    for cause in YIELD_CAUSES:
        TRAINER_YIELD.labels(cause)
    for kind in ArtifactKind:
        ARTIFACTS_STORED.labels(kind.value)
        ARTIFACT_BYTES.labels(kind.value)
        ARTIFACT_DELIVERY.labels(kind.value)


def endpoint_metrics(endpoint: str) -> None:
    """Create an endpoint's request, duration and error series (each code) at zero."""
    API_REQUESTS.labels(endpoint)
    API_DURATION.labels(endpoint)
    for code in ErrorCode:
        API_ERRORS.labels(endpoint, code.value)


def reports_committed(reports: Sequence[StatusReport], applied: int, refused: int) -> None:
    """A committed batch of status reports: counts, and each one's lag."""
    now = dt.datetime.now(dt.UTC)
    STATUS_APPLIED.inc(applied)
    if refused:
        STATUS_REFUSED.inc(refused)
    for r in reports:
        STATUS_LAG.observe(max(0.0, (now - r.time).total_seconds()))


def job_started(created_at: dt.datetime) -> None:
    """A node accepted a job submitted at `created_at`."""
    JOBS_DISPATCHED.inc()
    JOB_START_LATENCY.observe(max(0.0, (dt.datetime.now(dt.UTC) - created_at).total_seconds()))


def node_departed(how: str) -> None:
    """A node went away: "left" (clean stop), "expired" or "silent"."""
    if how == "left":
        NODES_LEFT.inc()
    else:
        NODES_LOST.labels(how).inc()


def artifact_stored(kind: str, size: int, duration_s: float) -> None:
    """An artifact of `size` bytes committed, `duration_s` after its first chunk."""
    ARTIFACTS_STORED.labels(kind).inc()
    ARTIFACT_BYTES.labels(kind).inc(size)
    ARTIFACT_DELIVERY.labels(kind).observe(duration_s)


# --- live gauges --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LiveGauge:
    """A gauge computed at scrape time."""

    name: str
    help: str
    labels: tuple[str, ...] = ()


JOBS = LiveGauge("lorafleet_jobs", "Jobs in the recorder's database, by state", ("state",))
QUEUE_DEPTH = LiveGauge("lorafleet_queue_depth", "Jobs waiting in the queue")
QUEUE_OLDEST_AGE = LiveGauge(
    "lorafleet_queue_oldest_age_seconds", "Seconds the oldest queued job has waited (0: none)"
)
NODES_ALIVE = LiveGauge("lorafleet_nodes_alive", "Nodes heartbeating now")
NODE_UP = LiveGauge("lorafleet_node_up", "1 while a node heartbeats, 0 once lost", ("node",))
NODE_BUSY = LiveGauge("lorafleet_node_busy", "1 while a node runs a job", ("node",))
HEARTBEAT_AGE = LiveGauge(
    "lorafleet_node_heartbeat_age_seconds", "Seconds since a node's last heartbeat", ("node",)
)
CARD_TOTAL = LiveGauge(
    "lorafleet_card_memory_total_bytes", "A card's memory", ("node", "card", "name")
)
CARD_FREE = LiveGauge(
    "lorafleet_card_memory_free_bytes",
    "A card's free memory, as its node's last heartbeat carried it",
    ("node", "card", "name"),
)
LEADER = LiveGauge("lorafleet_scheduler_leader", "1 while this scheduler replica leads")
_JOB = ("node", "job_id")
JOB_STEP = LiveGauge("lorafleet_job_step", "A running job's optimizer step", _JOB)
JOB_STEPS = LiveGauge("lorafleet_job_steps", "A running job's total optimizer steps", _JOB)
JOB_LOSS = LiveGauge("lorafleet_job_loss", "A running job's last training loss", _JOB)
JOB_EVAL_LOSS = LiveGauge("lorafleet_job_eval_loss", "A running job's last eval loss", _JOB)
JOB_TOKENS = LiveGauge(
    "lorafleet_job_tokens_per_second", "A running job's training throughput", _JOB
)
JOB_PEAK = LiveGauge(
    "lorafleet_job_peak_memory_bytes", "A running job's peak card memory (RSS on the CPU)", _JOB
)
JOB_ETA = LiveGauge("lorafleet_job_eta_seconds", "Seconds a running job expects to need", _JOB)
SERVINGS = LiveGauge(
    "lorafleet_servings", "Serving records in the recorder's database, by state", ("state",)
)
NODE_ADAPTERS = LiveGauge(
    "lorafleet_node_adapters_loaded",
    "Adapters a live node's engines have loaded, as its heartbeat says",
    ("node",),
)

#: Every live gauge, in exposition order.
LIVE_GAUGES = (
    JOBS, QUEUE_DEPTH, QUEUE_OLDEST_AGE, NODES_ALIVE, NODE_UP, NODE_BUSY, HEARTBEAT_AGE,
    CARD_TOTAL, CARD_FREE, LEADER, JOB_STEP, JOB_STEPS, JOB_LOSS, JOB_EVAL_LOSS, JOB_TOKENS,
    JOB_PEAK, JOB_ETA, SERVINGS, NODE_ADAPTERS,
)  # fmt: skip

#: One live sample: its gauge, its label values (in the gauge's order), its value.
Sample = tuple[LiveGauge, tuple[str, ...], float]
View = Callable[[], Iterable[Sample]]
Refresher = Callable[[], Awaitable[None]]

#: Seconds a scrape waits for the refreshers (the recorder's query) at most.
REFRESH_TIMEOUT_S = 5.0


class LiveCollector(Collector):
    """The live gauges: each scrape asks every registered view.

    Views are added by services at start and removed at stop (`add` returns
    the remover). `register` puts `LIVE` on the process-wide registry.
    """

    def __init__(self) -> None:
        self._views: dict[int, View] = {}
        self._refreshers: dict[int, Refresher] = {}
        self._next = 0

    def add(self, view: View | None = None, refresh: Refresher | None = None) -> Callable[[], None]:
        """Register a view (and an async refresher run before each scrape)."""
        key = self._next
        self._next += 1
        if view is not None:
            self._views[key] = view
        if refresh is not None:
            self._refreshers[key] = refresh

        def remove() -> None:
            self._views.pop(key, None)
            self._refreshers.pop(key, None)

        return remove

    async def refresh(self) -> None:
        """Run every refresher; one that fails or is slow is logged, never raised."""
        for fn in list(self._refreshers.values()):
            try:
                await asyncio.wait_for(fn(), REFRESH_TIMEOUT_S)
            except Exception as e:
                log.get().warning(Event.METRICS_FAILED, error=repr(e), message="refresh")

    def describe(self) -> list[Metric]:
        return []  # registering must not collect

    def collect(self) -> Iterator[Metric]:
        families = {g.name: GaugeMetricFamily(g.name, g.help, labels=g.labels) for g in LIVE_GAUGES}
        for view in list(self._views.values()):
            for gauge, values, value in view():
                families[gauge.name].add_metric(list(values), value)
        yield from (f for f in families.values() if f.samples)


LIVE = LiveCollector()


# --- registering ------------------------------------------------------------------

#: The event metrics each service exports (every process: `_COMMON`).
_COMMON = (BUILD_INFO, API_REQUESTS, API_ERRORS, API_DURATION)
SERVICE_METRICS: dict[str, tuple[Any, ...]] = {
    "recorder": (JOBS_SUBMITTED, JOBS_FINISHED, STATUS_APPLIED, STATUS_REFUSED, STATUS_LAG),
    "scheduler": (
        JOB_START_LATENCY,
        JOBS_DISPATCHED,
        DISPATCH_ROUND,
        NODES_LOST,
        NODES_LEFT,
        SERVE_REQUESTS,
    ),
    "artifact-store": (ARTIFACTS_STORED, ARTIFACT_BYTES, ARTIFACTS_REJECTED, ARTIFACT_DELIVERY),
    "agent": (TRAINER_YIELD,),
}
_registered: set[int] = set()


def register(service: str) -> None:
    """Export the metrics of `service` (and every process's) and the live
    gauges from this process; idempotent (in-process tests run several services)."""
    # The `_created` series double every counter's and histogram's series for
    # a timestamp no panel uses.
    disable_created_metrics()  # type: ignore[no-untyped-call]
    _preset()
    for metric in (LIVE, *_COMMON, *SERVICE_METRICS.get(service, ())):
        if id(metric) not in _registered:
            REGISTRY.register(metric)
            _registered.add(id(metric))
