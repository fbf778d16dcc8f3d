"""A short nemesis run in the suite: bench/nemesis.py, as a person runs it,
for one seed; its checker must find no violation (docs/nemesis.md)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
#: Seconds the whole run may take before the test gives up on it.
RUN_TIMEOUT_S = 300
#: Seconds a run given up on has to remove what it made.
CLEANUP_TIMEOUT_S = 60
#: Seed -> minutes of faults. Seed 1 is the short run (about 2 minutes with the
#: fleet's start, the settling and the final reads on this 2-core machine).
#: The seeds that found a bug (3: a scheduler restarted on a member cut off
#: from the others exited at start) are pinned by tests/nemesis/test_found*.py,
#: each bug reproduced on its own in seconds; their whole runs are
#: `bench/nemesis.py --seed 3 --minutes 1` (docs/nemesis.md), not the suite's
#: minutes. So is seed 8 (2 minutes: false losses by a scheduler without the
#: lease, pinned by tests/scheduler/test_nodes.py).
SEEDS = {1: 0.5}


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + CLEANUP_TIMEOUT_S + 30)
@pytest.mark.parametrize("seed", sorted(SEEDS))
def test_a_seeded_nemesis_run_breaks_no_rule(seed: int, tmp_path: Path) -> None:
    history = tmp_path / "history.jsonl"
    # The session's own children (its vLLM server, started by an earlier test) stay.
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    argv = [sys.executable, str(ROOT / "bench" / "nemesis.py"), "--minutes", str(SEEDS[seed]),
            "--seed", str(seed), "--history", str(history)]  # fmt: skip
    with subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as run:
        try:
            out, err = run.communicate(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            # SIGINT: the run's context managers remove what it made (the
            # PostgreSQL cluster, the namespaces), which a SIGKILL would leave.
            run.send_signal(signal.SIGINT)
            out, err = run.communicate(timeout=CLEANUP_TIMEOUT_S)
            pytest.fail(f"the nemesis run took over {RUN_TIMEOUT_S} s:\n{out}\n{err[-4000:]}")
    assert run.returncode == 0, out + err[-4000:]
    assert f"seed {seed}: no violation" in out
    # It left no process of its own behind (the run is a child of this test).
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert left == []
