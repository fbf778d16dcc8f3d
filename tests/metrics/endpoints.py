"""Reading the stack's metrics endpoints directly (no Prometheus)."""

from __future__ import annotations

import asyncio
import urllib.request
from urllib.parse import urlparse

from prometheus_client.parser import text_string_to_metric_families

from tests.procs import ServiceProcess


def metrics_url(proc: ServiceProcess) -> str:
    """Where a child serves its metrics: the `metrics` of its `service.started` line."""
    started = proc.events("service.started")
    assert started and "metrics" in started[-1], f"{proc.module} serves no metrics: {started}"
    return str(started[-1]["metrics"])


def host_port(url: str) -> str:
    return urlparse(url).netloc


async def scrape(url: str) -> str:
    def get() -> str:
        with urllib.request.urlopen(url, timeout=10) as r:
            return bytes(r.read()).decode()

    return await asyncio.to_thread(get)


def series(text: str, prefix: str = "lorafleet_") -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    """Every series (name and labels) of an exposition whose name starts with `prefix`."""
    return {
        (s.name, tuple(sorted(s.labels.items())))
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith(prefix)
    }
