"""The clock-step fault (tests/clock_step.py): a process started with a
node's clock reads the host's wall clock plus the node's offset, within a
second of each step, forward and back; its monotonic clock, its sleeps and
its children's clocks go on as on a real node whose clock was stepped."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import clock_step

#: Per line read: the wall clock's lead over the monotonic one (system-wide)
#: since it started, datetime's lead over time.time(), and a child's lead.
CHILD = """
import datetime, subprocess, sys, time
base = time.time() - time.monotonic()
lead = "import time; print(time.time() - time.monotonic())"
for _ in sys.stdin:
    time.sleep(0.05)
    now = datetime.datetime.now(datetime.UTC).timestamp()
    mine = time.time() - time.monotonic() - base
    out = subprocess.run([sys.executable, "-c", lead], capture_output=True, text=True, check=True)
    theirs = float(out.stdout) - base
    print(round(mine, 1), round(now - time.time(), 1), round(theirs, 1), flush=True)
"""


@pytest.mark.skipif(clock_step.unavailable() is not None, reason=str(clock_step.unavailable()))
def test_a_node_clock_steps_forward_and_back_its_monotonic_clock_does_not(tmp_path: Path) -> None:
    clock = clock_step.NodeClock(clock_step.build(tmp_path / "lib"), tmp_path / "clock-node-1")
    seen: list[tuple[float, ...]] = []
    with subprocess.Popen(
        [sys.executable, "-c", CHILD], env={**os.environ, **clock.env()},
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    ) as child:  # fmt: skip
        assert child.stdin is not None and child.stdout is not None
        for offset_s in (0.0, 30.0, -45.0, 0.0):
            clock.set(offset_s)
            time.sleep(clock_step.READ_EVERY_S + 0.2)
            child.stdin.write("read\n")
            child.stdin.flush()
            seen.append(tuple(float(x) for x in child.stdout.readline().split()))
        child.stdin.close()
        child.wait(10)
    assert child.returncode == 0
    # The wall clock's lead is the offset; datetime reads the same clock; so
    # does a child the process starts.
    # (Within half a second: the reads are apart by the time between them.)
    expected = [(0.0, 0.0, 0.0), (30.0, 0.0, 30.0), (-45.0, 0.0, -45.0), (0.0, 0.0, 0.0)]
    assert [tuple(round(x) for x in read) for read in seen] == expected, seen
