"""The compose stack's Prometheus and Grafana files agree with each other and
with the dashboard (Grafana itself cannot run here; Prometheus's checker can)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

COMPOSE = Path(__file__).resolve().parents[2] / "compose"
DASHBOARD = COMPOSE / "grafana/dashboards/lorafleet.json"


def provisioned_uids() -> set[str]:
    text = " ".join(
        p.read_text() for p in (COMPOSE / "grafana/provisioning/datasources").glob("*.yml")
    )
    return set(re.findall(r"uid:\s*([\w-]+)", text))


def test_every_datasource_the_dashboard_uses_is_provisioned() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    used = {p["datasource"]["uid"] for p in dashboard["panels"]}
    used |= {t["datasource"]["uid"] for p in dashboard["panels"] for t in p["targets"]}
    used |= {v["datasource"]["uid"] for v in dashboard["templating"]["list"]}
    assert used == {"prometheus", "loki"}
    assert used <= provisioned_uids()


def test_every_variable_a_panel_uses_is_defined() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    defined = {v["name"] for v in dashboard["templating"]["list"]}
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    used = set(re.findall(r"\$(\w+)", exprs)) - {"__rate_interval", "__interval"}
    assert used == defined == {"job_id"}


def test_the_panels_do_not_overlap() -> None:
    cells: dict[tuple[int, int], str] = {}
    for p in json.loads(DASHBOARD.read_text())["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, f"{p['title']} is wider than the grid"
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = p["title"]


def test_the_compose_prometheus_config_is_valid() -> None:
    assert shutil.which("promtool"), "promtool is missing: apt-get install prometheus (./dev does)"
    out = subprocess.run(
        ["promtool", "check", "config", str(COMPOSE / "prometheus.yml")], capture_output=True
    )
    assert out.returncode == 0, (out.stdout + out.stderr).decode()
    compose = (COMPOSE / "docker-compose.yml").read_text()
    assert 'LORAFLEET_METRICS_ADDR: ":9460"' in compose
    for service in ("recorder", "scheduler", "artifact-store", "gateway"):
        assert (
            f"names: [{service}], type: A, port: 9460" in (COMPOSE / "prometheus.yml").read_text()
        )


def test_every_alert_fires_when_it_should() -> None:
    """compose/alerts_test.yml: promtool's unit tests of every alert rule."""
    assert shutil.which("promtool"), "promtool is missing: apt-get install prometheus (./dev does)"
    out = subprocess.run(
        ["promtool", "test", "rules", "alerts_test.yml"], cwd=COMPOSE, capture_output=True
    )
    assert out.returncode == 0, (out.stdout + out.stderr).decode()
    rules = set(re.findall(r"- alert: (\w+)", (COMPOSE / "alerts.yml").read_text()))
    tested = set(re.findall(r"alertname: (\w+)", (COMPOSE / "alerts_test.yml").read_text()))
    assert rules == tested, f"alerts without a test: {sorted(rules - tested)}"
