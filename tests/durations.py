"""The slowest work first: a parallel run's order, from measured test times.

pytest-xdist's `loadgroup` hands each worker a unit of work at a time (a
group's tests together, any other test alone) in the order the workers
collected them, and a unit given out is not taken back. A two-minute test
handed out in the last minute makes the run two minutes longer while the
other workers sit idle. So on a worker the collection is ordered by each
unit's measured time, slowest first (`order_slowest_first`), and the tail of
the run is made of short tests that even out. `./dev test` passes
`--no-loadscope-reorder`, or xdist would reorder the units by test count.

The times come from `tests/durations.json`, checked in (a fresh clone has
no cache to learn from): every test that took at least `RECORDED_MIN_S` in
a run, set-up and tear-down included. Refresh it after a change that moves
them (`./dev test --record-durations`, which rewrites it at the end of the
run). A test missing from it counts `UNKNOWN_S`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

DURATIONS_FILE = Path(__file__).with_name("durations.json")

#: A test faster than this is not recorded: it counts UNKNOWN_S anyway.
RECORDED_MIN_S = 1.0
UNKNOWN_S = 0.5


def recorded_id(nodeid: str) -> str:
    """The id without xdist's `@group` suffix, as recorded (an `@` inside a
    parameter's id, before its closing `]`, stays)."""
    head, at, tail = nodeid.rpartition("@")
    return head if at and "]" not in tail and "::" not in tail else nodeid


def unit_of(item: pytest.Item) -> str:
    """The unit xdist's loadgroup hands out whole: the item's group, else itself."""
    marker = item.get_closest_marker("xdist_group")
    if marker is not None:
        return str(marker.args[0] if marker.args else marker.kwargs.get("name", "default"))
    return item.nodeid


def order_slowest_first(items: list[pytest.Item], seconds: dict[str, float]) -> None:
    """Reorder `items` in place: units by their total measured time, slowest
    first; the tests of a unit keep their order, ties keep collection order."""
    units: dict[str, list[pytest.Item]] = {}
    for item in items:
        units.setdefault(unit_of(item), []).append(item)

    def cost(unit: list[pytest.Item]) -> float:
        return sum(seconds.get(recorded_id(item.nodeid), UNKNOWN_S) for item in unit)

    ordered = sorted(units.values(), key=cost, reverse=True)  # sorted() is stable
    items[:] = [item for unit in ordered for item in unit]


def load_durations(path: Path = DURATIONS_FILE) -> dict[str, float]:
    if not path.exists():
        return {}
    loaded = json.loads(path.read_text())
    return {str(nodeid): float(s) for nodeid, s in loaded.items()}


class DurationRecorder:
    """Sums each test's phases as the reports reach the controller (or the
    one process of a serial run) and writes the slow ones at the end."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        nodeid = recorded_id(report.nodeid)
        self.seconds[nodeid] = self.seconds.get(nodeid, 0.0) + report.duration

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if hasattr(session.config, "workerinput"):  # a worker: the controller writes
            return
        slow = {k: round(s, 1) for k, s in self.seconds.items() if s >= RECORDED_MIN_S}
        ordered = dict(sorted(slow.items(), key=lambda kv: (-kv[1], kv[0])))
        self.path.write_text(json.dumps(ordered, indent=0) + "\n")
