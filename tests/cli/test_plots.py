"""Without matplotlib (the `plots` extra), --png says how to install it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lorafleet_schemas.messages import JobCurve, LossPoint
from lorafleet_services.cli.plots import PlotsMissingError, write_png
from tests.cli.test_follow import record


def test_without_matplotlib_the_png_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    curve = JobCurve(id="j1", points=[LossPoint(step=1, loss=2.0)], events=[])
    with pytest.raises(PlotsMissingError, match=r"pip install 'lorafleet\[plots\]'"):
        write_png(record(), curve, tmp_path / "loss.png")
    assert not (tmp_path / "loss.png").exists()
