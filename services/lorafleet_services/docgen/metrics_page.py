"""docs/metrics.md's table: every metric lorafleet.metrics defines, its type,
labels, the processes that export it and its help text. Which service
exports a live gauge is read from the service's code: the modules that name
it (`metrics.LEADER`, or imported from lorafleet.metrics)."""

from __future__ import annotations

import ast
from pathlib import Path

from prometheus_client import Counter, Gauge, Histogram

import lorafleet_services
from lorafleet import metrics
from lorafleet_services.docgen._markdown import code, prose, table

_SERVICES_DIR = Path(lorafleet_services.__file__).parent
#: {service as the metrics name it: its package}.
SERVICE_PACKAGES = {
    "recorder": "recorder",
    "scheduler": "scheduler",
    "artifact-store": "artifact_store",
    "agent": "agent",
    "gateway": "gateway",
}


class UnexportedMetricError(ValueError):
    """A live gauge no service's code names: defined, never exported."""


def table_of_metrics() -> str:
    """One row per metric: event metrics in registering order, then the live gauges."""
    rows = []
    every = ("every process", metrics._COMMON)
    for source, defined in (every, *metrics.SERVICE_METRICS.items()):
        rows += [_event_row(metric, source) for metric in defined]
    exporters = live_exporters()
    for gauge in metrics.LIVE_GAUGES:
        if gauge.name not in exporters:
            raise UnexportedMetricError(
                f"{gauge.name}: no service's code names it; export it or drop it"
            )
        rows.append(
            _row(gauge.name, "gauge", gauge.labels, ", ".join(exporters[gauge.name]), gauge.help)
        )
    return table(("metric", "type", "from", "what"), rows)


def live_exporters() -> dict[str, list[str]]:
    """{live gauge's name: the services whose code names it}."""
    by_attr = {n: v.name for n, v in vars(metrics).items() if isinstance(v, metrics.LiveGauge)}
    out: dict[str, list[str]] = {}
    for service, package in SERVICE_PACKAGES.items():
        named: set[str] = set()
        for module in sorted((_SERVICES_DIR / package).rglob("*.py")):
            named |= _gauges_named(ast.parse(module.read_text()), by_attr)
        for gauge in sorted(named):
            out.setdefault(gauge, []).append(service)
    return out


def _gauges_named(tree: ast.AST, by_attr: dict[str, str]) -> set[str]:
    """The live gauges a module names: imported from lorafleet.metrics, or `metrics.X`."""
    named = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "lorafleet.metrics":
            named |= {by_attr[a.name] for a in node.names if a.name in by_attr}
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "metrics"
            and node.attr in by_attr
        ):
            named.add(by_attr[node.attr])
    return named


def _event_row(metric: Counter | Gauge | Histogram, source: str) -> tuple[str, ...]:
    name = metric._name
    kind = metric._type
    if isinstance(metric, Counter):
        name += "_total"  # prometheus_client's exposition adds it
    return _row(name, kind, tuple(metric._labelnames), source, metric._documentation)


def _row(name: str, kind: str, labels: tuple[str, ...], source: str, what: str) -> tuple[str, ...]:
    labelled = f"{name}{{{','.join(labels)}}}" if labels else name
    return (code(labelled), kind, source, prose(what))
