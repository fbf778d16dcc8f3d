"""Prometheus metrics of every lorafleet process, defined once, and their endpoint.

Every metric lorafleet exports is defined in this module, named the
Prometheus way (base units: seconds and bytes; counters end in `_total`).
A service updates them with one call per event (`metrics.JOBS_SUBMITTED.inc()`);
`runtime.serve()` starts the endpoint (`MetricsServer`, `GET /metrics`) for
every Program when `LORAFLEET_METRICS_ADDR` is set (off by default).

Two kinds of metric:

- event metrics (counters, histograms) on prometheus_client's process-wide
  registry, which also carries its `process_*` and `python_*` collectors;
- live gauges (`LIVE`), computed at each scrape from what the process
  knows now: the scheduler's node table (nodes, cards, heartbeat age), the
  agent's running job (`RUNNING_JOBS`), the recorder's jobs by state
  (`JOB_COUNTS`, read from the database before each scrape). Their labels
  are bounded by what exists now: a finished job's series stay
  `metrics_linger_s` seconds (so that the last scrape sees its final
  values), then go away; a forgotten node's series go with it.

The endpoint is a small asyncio server in the service's own event loop (not
prometheus_client's thread): collecting reads the service's tables on the
loop that changes them, and the recorder can await its database query.

Label names: `node`, `job_id` (never `job`: Prometheus uses it for the
scrape job), `card`, `state`, `kind`, `endpoint`, `code`.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

import lorafleet.log as log
from lorafleet.log import Event
from lorafleet.settings import SettingsError, parse_host_port
from lorafleet_schemas.messages import ArtifactKind, ErrorCode, Heartbeat, JobState, StatusReport

MIB = 1024 * 1024

# The `_created` series double every counter's and histogram's series for a
# timestamp no panel uses.
disable_created_metrics()  # type: ignore[no-untyped-call]

#: Final states, in the order the finished counter is pre-set (zero series
#: exist before the first job ends, so a panel over them has data).
_FINAL = (JobState.DONE, JobState.FAILED, JobState.CANCELLED)

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
    for kind in ArtifactKind:
        ARTIFACTS_STORED.labels(kind.value)
        ARTIFACT_BYTES.labels(kind.value)
        ARTIFACT_DELIVERY.labels(kind.value)


_preset()

#: The event metrics each service exports (every process: `_COMMON`).
_COMMON = (BUILD_INFO, API_REQUESTS, API_ERRORS, API_DURATION)
SERVICE_METRICS: dict[str, tuple[Any, ...]] = {
    "recorder": (JOBS_SUBMITTED, JOBS_FINISHED, STATUS_APPLIED, STATUS_REFUSED, STATUS_LAG),
    "scheduler": (JOB_START_LATENCY, JOBS_DISPATCHED, DISPATCH_ROUND, NODES_LOST, NODES_LEFT),
    "artifact-store": (ARTIFACTS_STORED, ARTIFACT_BYTES, ARTIFACTS_REJECTED, ARTIFACT_DELIVERY),
    "agent": (),
}
_registered: set[int] = set()


def register(service: str) -> None:
    """Export the metrics of `service` (and every process's) from this
    process; idempotent (in-process tests run several services)."""
    for metric in (*_COMMON, *SERVICE_METRICS.get(service, ())):
        if id(metric) not in _registered:
            REGISTRY.register(metric)
            _registered.add(id(metric))


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

#: Every live gauge, in exposition order.
LIVE_GAUGES = (
    JOBS, QUEUE_DEPTH, QUEUE_OLDEST_AGE, NODES_ALIVE, NODE_UP, NODE_BUSY, HEARTBEAT_AGE,
    CARD_TOTAL, CARD_FREE, LEADER, JOB_STEP, JOB_STEPS, JOB_LOSS, JOB_EVAL_LOSS, JOB_TOKENS,
    JOB_PEAK, JOB_ETA,
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
    the remover). Registered once, at import, on the process-wide registry.
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
REGISTRY.register(LIVE)


# --- the recorder's jobs by state ---------------------------------------------


@dataclass
class JobCounts:
    """Jobs by state as the recorder's last query found them (None: never asked)."""

    by_state: dict[str, int] | None = None
    #: Seconds the oldest queued job has waited, when the query ran.
    oldest_queued_s: float = 0.0

    def set(self, by_state: Mapping[str, int], oldest_queued_s: float) -> None:
        self.by_state = {s.value: int(by_state.get(s.value, 0)) for s in JobState}
        self.oldest_queued_s = max(0.0, oldest_queued_s)

    def samples(self) -> Iterator[Sample]:
        if self.by_state is None:
            return
        for state, n in self.by_state.items():
            yield JOBS, (state,), float(n)
        yield QUEUE_DEPTH, (), float(self.by_state[JobState.QUEUED.value])
        yield QUEUE_OLDEST_AGE, (), self.oldest_queued_s


# --- the scheduler's node table -----------------------------------------------


def node_samples(nodes: Iterable[tuple[Heartbeat, bool, float]]) -> Iterator[Sample]:
    """Samples of (heartbeat, alive, seconds since it arrived) for each known node."""
    alive = 0
    for hb, up, age_s in nodes:
        alive += up
        yield NODE_UP, (hb.node,), float(up)
        yield NODE_BUSY, (hb.node,), float(up and hb.job is not None)
        yield HEARTBEAT_AGE, (hb.node,), max(0.0, age_s)
        if not up:
            continue  # a lost node's cards say nothing about now
        for card in hb.cards:
            labels = (hb.node, str(card.index), card.name)
            yield CARD_TOTAL, labels, float(card.total_mib * MIB)
            yield CARD_FREE, labels, float(card.free_mib * MIB)
    yield NODES_ALIVE, (), float(alive)


# --- the agent's running job --------------------------------------------------

_JOB_FIELDS: dict[str, tuple[LiveGauge, float]] = {
    "step": (JOB_STEP, 1.0),
    "steps": (JOB_STEPS, 1.0),
    "loss": (JOB_LOSS, 1.0),
    "eval_loss": (JOB_EVAL_LOSS, 1.0),
    "tokens_per_s": (JOB_TOKENS, 1.0),
    "peak_mib": (JOB_PEAK, float(MIB)),
    "eta_s": (JOB_ETA, 1.0),
}


@dataclass
class _JobValues:
    values: dict[str, float] = field(default_factory=dict)
    #: Monotonic seconds when the job ended here (None: running).
    ended_at: float | None = None


class RunningJobs:
    """The progress of the jobs an agent runs now, as its status reports carry it.

    linger_s: seconds a finished job's series stay; default 60 (see the
    module docstring). clock: monotonic seconds.
    """

    def __init__(self, linger_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self.linger_s = linger_s
        self.clock = clock
        self._jobs: dict[tuple[str, str], _JobValues] = {}

    def report(self, node: str, job_id: str, fields: Mapping[str, Any]) -> None:
        """Keep each progress field of a status report that carries one."""
        job = self._jobs.setdefault((node, job_id), _JobValues())
        for name, value in fields.items():
            if value is not None and name in _JOB_FIELDS:
                job.values[name] = float(value)

    def ended(self, node: str, job_id: str) -> None:
        job = self._jobs.get((node, job_id))
        if job is not None and job.ended_at is None:
            job.ended_at = self.clock()
        self._prune()  # also where nothing scrapes: the table stays bounded

    def __len__(self) -> int:
        """Jobs held: running, or finished and lingering."""
        return len(self._jobs)

    def _prune(self) -> None:
        now = self.clock()
        for key, job in list(self._jobs.items()):
            if job.ended_at is not None and now - job.ended_at >= self.linger_s:
                del self._jobs[key]

    def samples(self) -> Iterator[Sample]:
        self._prune()
        for key, job in list(self._jobs.items()):
            for name, value in job.values.items():
                gauge, scale = _JOB_FIELDS[name]
                yield gauge, key, value * scale


JOB_COUNTS = JobCounts()
RUNNING_JOBS = RunningJobs()
LIVE.add(JOB_COUNTS.samples)
LIVE.add(RUNNING_JOBS.samples)


# --- the endpoint ---------------------------------------------------------------

#: Bytes of a request's head the endpoint reads at most.
MAX_REQUEST_BYTES = 8192
#: Seconds a client has to send its request line and headers.
REQUEST_TIMEOUT_S = 5.0


def exposition() -> bytes:
    """The process's metrics in Prometheus's text format (without refreshing)."""
    return generate_latest(REGISTRY)


class MetricsServer:
    """`GET /metrics` on `addr` ("host:port"; port 0 picks a free one).

    start() binds (a port in use raises SettingsError naming the setting);
    `url` is where it listens; stop() closes it.
    """

    def __init__(self, addr: str, setting: str = "LORAFLEET_METRICS_ADDR") -> None:
        self.addr = addr
        self.setting = setting
        self.host, self.port = parse_host_port(addr, setting)
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        host = self.host or "0.0.0.0"
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}/metrics"

    async def start(self) -> None:
        try:
            self._server = await asyncio.start_server(self._handle, self.host or None, self.port)
        except OSError as e:
            raise SettingsError(
                f"{self.setting}={self.addr!r}: cannot listen there ({e.strerror}); "
                "choose a free port (0 picks one), or unset it to serve no metrics"
            ) from None
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT_S)
            writer.write(await respond(head))
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
            pass
        except ConnectionError:
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


async def respond(head: bytes) -> bytes:
    """The whole HTTP/1.1 response to a request's head."""
    parts = head.split(b"\r\n", 1)[0].split()
    method, path = (parts[0], parts[1].split(b"?", 1)[0]) if len(parts) >= 2 else (b"", b"")
    if method not in (b"GET", b"HEAD"):
        return _response(405, b"text/plain", b"GET /metrics\n", method == b"HEAD")
    if path == b"/metrics":
        await LIVE.refresh()
        return _response(200, CONTENT_TYPE_LATEST.encode(), exposition(), method == b"HEAD")
    if path == b"/":
        return _response(200, b"text/plain", b"lorafleet: metrics at /metrics\n", False)
    return _response(404, b"text/plain", b"not found: metrics are at /metrics\n", False)


_REASONS = {200: b"OK", 404: b"Not Found", 405: b"Method Not Allowed"}


def _response(status: int, content_type: bytes, body: bytes, head_only: bool) -> bytes:
    lines = [
        b"HTTP/1.1 %d %s" % (status, _REASONS[status]),
        b"Content-Type: " + content_type,
        b"Content-Length: %d" % len(body),
        b"Connection: close",
    ]
    return b"\r\n".join(lines) + b"\r\n\r\n" + (b"" if head_only else body)


# --- several processes on one machine (lorafleet up) ------------------------------


def child_addr(base: str, index: int, setting: str = "LORAFLEET_METRICS_ADDR") -> str:
    """The address of the `index`-th process when they share `base`: the
    port plus `index` (port 0 stays 0: each picks its own). "" stays off."""
    if not base:
        return ""
    host, port = parse_host_port(base, setting)
    if port == 0:
        return base
    host = f"[{host}]" if ":" in host else host
    return f"{host}:{port + index}"


def endpoints_text(urls: Mapping[str, str]) -> str:
    """Lines saying where each process serves its metrics (for `lorafleet up`)."""
    if not urls:
        return "metrics: off (set LORAFLEET_METRICS_ADDR, e.g. 127.0.0.1:9460, to serve them)"
    width = max(map(len, urls))
    return "\n".join(f"metrics: {name:<{width}}  {url}" for name, url in urls.items())
