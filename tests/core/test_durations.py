"""tests/durations.py: a parallel run hands out the slowest units first, and
a run records what it measured."""

from __future__ import annotations

import json

import pytest

from tests.durations import DurationRecorder, order_slowest_first, recorded_id

pytest_plugins = ["pytester"]


@pytest.fixture(autouse=True)
def inner_config(pytester: pytest.Pytester) -> None:
    """The inner sessions' pytest-asyncio setting, as the project's own."""
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")


MODULE = """
import pytest

def test_fast(): pass

@pytest.mark.xdist_group("shared")
def test_grouped_first(): pass

@pytest.mark.xdist_group("shared")
def test_grouped_second(): pass

def test_unknown(): pass

def test_slow(): pass
"""


def test_units_slowest_first_each_group_whole_and_in_order(pytester: pytest.Pytester) -> None:
    items = pytester.getitems(MODULE)
    ids = {item.name: item.nodeid for item in items}
    seconds = {
        ids["test_slow"]: 30.0,
        # the group counts 16 s together; its second test alone is the slower
        ids["test_grouped_first"]: 1.0,
        ids["test_grouped_second"]: 15.0,
        ids["test_fast"]: 1.0,  # more than an unknown test's UNKNOWN_S
    }
    order_slowest_first(items, seconds)
    assert [item.name for item in items] == [
        "test_slow",
        "test_grouped_first",
        "test_grouped_second",
        "test_fast",
        "test_unknown",
    ]


def test_xdist_group_suffix_stripped_parameter_ids_kept() -> None:
    assert recorded_id("tests/a.py::test_x@vllm") == "tests/a.py::test_x"
    assert recorded_id("tests/a.py::test_x[p@q]@tests/a.py") == "tests/a.py::test_x[p@q]"
    assert recorded_id("tests/a.py::test_x[p@q]") == "tests/a.py::test_x[p@q]"
    assert recorded_id("tests/a.py::test_x") == "tests/a.py::test_x"


def test_recorder_writes_the_slow_tests_only(pytester: pytest.Pytester) -> None:
    recorded = pytester.path / "durations.json"
    pytester.makepyfile(
        test_timed="""
        import time

        def test_slow():
            time.sleep(1.05)

        def test_quick():
            pass
        """
    )
    result = pytester.runpytest_inprocess("-p", "no:xdist", plugins=[DurationRecorder(recorded)])
    result.assert_outcomes(passed=2)
    written = json.loads(recorded.read_text())
    assert list(written) == ["test_timed.py::test_slow"]
    assert written["test_timed.py::test_slow"] >= 1.0
