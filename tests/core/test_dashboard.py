"""The Grafana dashboard selects on event names: each must be in the fixed vocabulary."""

from __future__ import annotations

import json
import re
from pathlib import Path

from lorafleet.log import Event

DASHBOARD = Path(__file__).resolve().parents[2] / "compose/grafana/dashboards/lorafleet.json"


def vocabulary() -> set[str]:
    return {v for k, v in vars(Event).items() if k.isupper() and isinstance(v, str)}


def test_dashboard_events_exist_in_the_vocabulary() -> None:
    text = " ".join(p["targets"][0]["expr"] for p in json.loads(DASHBOARD.read_text())["panels"])
    used: set[str] = set()
    for m in re.finditer(r'event=~?"([^"]+)"', text):
        used.update(m.group(1).split("|"))
    assert used, "the dashboard selects on no event"
    assert used <= vocabulary(), f"unknown events: {sorted(used - vocabulary())}"
