"""`lorafleet up`'s stack serves /metrics from every child, each on its own port."""

from __future__ import annotations

from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from lorafleet_services.stack import EmbeddedStack
from tests.metrics.endpoints import scrape


async def test_every_child_of_the_embedded_stack_serves_its_own_metrics(tmp_path: Path) -> None:
    stack = EmbeddedStack(data_dir=tmp_path / "data", metrics_addr="127.0.0.1:0")
    await stack.start()
    try:
        urls = stack.metrics_urls()
        assert sorted(urls) == ["artifact-store", "recorder", "scheduler"]
        assert len(set(urls.values())) == 3, f"two children share a port: {urls}"
        for service, url in urls.items():
            families = {f.name: f for f in text_string_to_metric_families(await scrape(url))}
            (info,) = families["lorafleet_build_info"].samples
            assert info.labels["service"] == service
    finally:
        await stack.stop()


async def test_no_metrics_unless_asked(tmp_path: Path) -> None:
    stack = EmbeddedStack(data_dir=tmp_path / "data")
    await stack.start()
    try:
        assert stack.metrics_urls() == {}
    finally:
        await stack.stop()
