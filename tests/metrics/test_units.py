"""lorafleet.metrics without a bus: definitions, the live gauges, the endpoint, settings."""

from __future__ import annotations

import asyncio
import datetime as dt
import shutil
import subprocess
import sys

import pytest
from prometheus_client.parser import text_string_to_metric_families

from lorafleet import metrics
from lorafleet._metrics_http import MetricsServer, child_addr, endpoints_text, exposition
from lorafleet.settings import Settings, SettingsError, parse_host_port
from lorafleet_schemas.messages import Card, Engine, EngineRef, Heartbeat
from lorafleet_services.agent.metric_views import RunningJobs
from lorafleet_services.recorder.metric_views import JobCounts
from lorafleet_services.scheduler.metric_views import node_samples
from lorafleet_trainer.memory import MIB


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def samples(view: metrics.View) -> dict[tuple[str, tuple[str, ...]], float]:
    return {(g.name, labels): value for g, labels, value in view()}


def beat(node: str, cards: list[tuple[int, int]], job: str | None = None) -> Heartbeat:
    t = dt.datetime.now(dt.UTC)
    return Heartbeat(
        node=node,
        version="1",
        started_at=t,
        time=t,
        job=job,
        cards=[
            Card(index=i, name="H100", total_mib=a, free_mib=b) for i, (a, b) in enumerate(cards)
        ],
    )


def test_running_jobs_keep_each_field_and_go_after_the_linger() -> None:
    clock = Clock()
    jobs = RunningJobs(linger_s=5.0, clock=clock)
    jobs.report("n1", "j1", {"step": 1, "steps": 4, "loss": 2.5, "peak_mib": 10, "eta_s": None})
    jobs.report("n1", "j1", {"step": 2, "eval_loss": 2.0, "message": "ignored"})
    got = samples(jobs.samples)
    assert got == {
        ("lorafleet_job_step", ("n1", "j1")): 2.0,
        ("lorafleet_job_steps", ("n1", "j1")): 4.0,
        ("lorafleet_job_loss", ("n1", "j1")): 2.5,
        ("lorafleet_job_eval_loss", ("n1", "j1")): 2.0,
        ("lorafleet_job_peak_memory_bytes", ("n1", "j1")): 10.0 * MIB,
    }
    jobs.ended("n1", "j1")
    clock.now += 4.9
    assert samples(jobs.samples) == got, "a finished job lingers for its last scrape"
    clock.now += 0.2
    assert samples(jobs.samples) == {}
    jobs.ended("n1", "never-ran")  # an unknown job ends quietly


def test_finished_jobs_go_even_where_nothing_scrapes() -> None:
    clock = Clock()
    jobs = RunningJobs(linger_s=1.0, clock=clock)
    for i in range(100):
        jobs.report("n1", f"j{i}", {"step": 1})
        jobs.ended("n1", f"j{i}")
        clock.now += 2.0
    assert len(jobs) == 1, "only the job still lingering is kept"


def test_node_samples_cover_cards_of_live_nodes_only() -> None:
    rows = [
        (beat("a", [(80, 70), (80, 12)], job="j"), True, 0.4),
        (beat("b", [(40, 1)]), False, 9.0),
    ]
    got = samples(lambda: node_samples(rows))
    assert got[("lorafleet_nodes_alive", ())] == 1.0
    assert got[("lorafleet_card_memory_free_bytes", ("a", "1", "H100"))] == 12 * MIB
    assert got[("lorafleet_card_memory_total_bytes", ("a", "0", "H100"))] == 80 * MIB
    assert got[("lorafleet_node_busy", ("a",))] == 1.0
    assert got[("lorafleet_node_up", ("b",))] == 0.0
    assert got[("lorafleet_node_heartbeat_age_seconds", ("b",))] == 9.0
    assert not any(name.startswith("lorafleet_card") and labels[0] == "b" for name, labels in got)


def test_job_counts_name_every_state() -> None:
    counts = JobCounts()
    assert list(counts.samples()) == [], "no query yet: no series (not zeros)"
    counts.set({"queued": 2, "done": 5}, oldest_queued_s=-1.0)
    got = samples(counts.samples)
    assert got[("lorafleet_jobs", ("queued",))] == 2.0
    assert got[("lorafleet_jobs", ("running",))] == 0.0
    assert got[("lorafleet_queue_depth", ())] == 2.0
    assert got[("lorafleet_queue_oldest_age_seconds", ())] == 0.0


def test_serving_records_by_state_and_each_live_nodes_adapters() -> None:
    counts = JobCounts()
    counts.set({"done": 1}, 0.0, {"served": 3, "refused": 1})
    got = samples(counts.samples)
    assert got[("lorafleet_servings", ("served",))] == 3.0
    assert got[("lorafleet_servings", ("refused",))] == 1.0
    assert got[("lorafleet_servings", ("loading",))] == 0.0  # every state, at zero too
    loaded = beat("a", [])
    loaded.serving = [
        EngineRef(kind=Engine.VLLM, url="http://h:1", adapters=["j1-x", "j2-y"]),
        EngineRef(kind=Engine.VLLM, url="http://h:2", adapters=["j3-z"]),
    ]
    lost = beat("b", [])
    lost.serving = [EngineRef(kind=Engine.VLLM, url="http://h:3", adapters=["j4-w"])]
    got = samples(lambda: node_samples([(loaded, True, 0.1), (lost, False, 9.0)]))
    assert got[("lorafleet_node_adapters_loaded", ("a",))] == 3.0
    assert ("lorafleet_node_adapters_loaded", ("b",)) not in got


def test_serve_requests_count_by_request_and_outcome_from_zero() -> None:
    metrics.register("scheduler")
    text = exposition().decode()
    for request in ("serve", "unserve"):
        for outcome in metrics.SERVE_OUTCOMES:
            assert (
                f'lorafleet_serve_requests_total{{outcome="{outcome}",request="{request}"}}' in text
            )


def test_live_collector_adds_and_removes_views() -> None:
    live = metrics.LiveCollector()
    remove = live.add(lambda: [(metrics.LEADER, (), 1.0)])
    families = {f.name: f for f in live.collect()}
    assert [s.value for s in families["lorafleet_scheduler_leader"].samples] == [1.0]
    remove()
    assert list(live.collect()) == []


async def test_a_failing_refresher_is_logged_not_raised() -> None:
    live = metrics.LiveCollector()
    calls: list[str] = []

    async def broken() -> None:
        calls.append("broken")
        raise RuntimeError("database gone")

    async def fine() -> None:
        calls.append("fine")

    live.add(refresh=broken)
    live.add(refresh=fine)
    await live.refresh()
    assert calls == ["broken", "fine"]


@pytest.mark.parametrize(
    ("addr", "want"),
    [("127.0.0.1:9460", ("127.0.0.1", 9460)), (":9460", ("", 9460)), ("[::1]:0", ("::1", 0))],
)
def test_parse_host_port(addr: str, want: tuple[str, int]) -> None:
    assert parse_host_port(addr, "X") == want


@pytest.mark.parametrize("addr", ["9460", "host:", "host:70000", "host:port"])
def test_a_bad_metrics_addr_says_what_to_write(addr: str) -> None:
    with pytest.raises(
        SettingsError, match=r"LORAFLEET_METRICS_ADDR=.*is not host:port: use e\.g\."
    ):
        Settings.from_env({"LORAFLEET_METRICS_ADDR": addr})


def test_metrics_are_off_by_default_and_linger_is_checked() -> None:
    assert Settings().metrics_addr == ""
    with pytest.raises(SettingsError, match="LORAFLEET_METRICS_LINGER_S must be >= 0"):
        Settings(metrics_linger_s=-1)


def test_child_addr_spreads_fixed_ports_and_keeps_port_zero() -> None:
    assert child_addr("127.0.0.1:9460", 2) == "127.0.0.1:9462"
    assert child_addr(":9460", 1) == ":9461"
    assert child_addr("127.0.0.1:0", 3) == "127.0.0.1:0"
    assert child_addr("", 3) == ""
    text = endpoints_text({"recorder": "http://127.0.0.1:9460/metrics"})
    assert "recorder  http://127.0.0.1:9460/metrics" in text
    assert "off" in endpoints_text({})


async def http_get(port: int, path: str, method: str = "GET") -> tuple[str, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"{method} {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    data = await reader.read()
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return head.split(b"\r\n")[0].decode(), body


async def test_the_endpoint_serves_the_registry_and_refreshes_first() -> None:
    metrics.register("recorder")
    refreshed: list[int] = []
    counts = JobCounts()

    async def refresh() -> None:
        refreshed.append(1)
        counts.set({"queued": 3}, 7.0)

    remove = metrics.LIVE.add(counts.samples, refresh=refresh)
    server = MetricsServer("127.0.0.1:0")
    await server.start()
    try:
        assert server.url == f"http://127.0.0.1:{server.port}/metrics"
        status, body = await http_get(server.port, "/metrics")
        assert status == "HTTP/1.1 200 OK" and refreshed == [1]
        names = {f.name for f in text_string_to_metric_families(body.decode())}
        assert {"lorafleet_jobs", "lorafleet_jobs_submitted", "lorafleet_build_info"} <= names
        assert (await http_get(server.port, "/nope"))[0] == "HTTP/1.1 404 Not Found"
        assert (await http_get(server.port, "/metrics", "POST"))[0].endswith(
            "405 Method Not Allowed"
        )
        status, body = await http_get(server.port, "/metrics", "HEAD")
        assert status.endswith("200 OK") and body == b""
    finally:
        remove()
        await server.stop()


async def test_a_port_in_use_is_a_settings_error() -> None:
    first = MetricsServer("127.0.0.1:0")
    await first.start()
    try:
        with pytest.raises(SettingsError, match=r"cannot listen there .*choose a free port"):
            await MetricsServer(f"127.0.0.1:{first.port}").start()
    finally:
        await first.stop()


def test_promtool_accepts_every_definition() -> None:
    for service in metrics.SERVICE_METRICS:
        metrics.register(service)
    metrics.endpoint_metrics("lorafleet.api.jobs.get")
    assert shutil.which("promtool"), "promtool is missing: apt-get install prometheus (./dev does)"
    text = exposition()
    out = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True)
    assert out.returncode == 0, out.stdout.decode() + out.stderr.decode()


def test_importing_the_definitions_registers_nothing() -> None:
    code = (
        "from prometheus_client import REGISTRY\n"
        "before = set(REGISTRY._collector_to_names)\n"
        "import lorafleet.metrics, lorafleet._metrics_http\n"
        "assert set(REGISTRY._collector_to_names) == before, 'import registered a collector'\n"
        "lorafleet.metrics.register('agent')\n"
        "assert lorafleet.metrics.LIVE in REGISTRY._collector_to_names\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
