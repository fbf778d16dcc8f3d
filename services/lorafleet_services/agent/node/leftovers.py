"""What an earlier agent with this work directory left behind, found and
removed when the agent starts (no job survives a restart): its trainers
still running (found by JOB_DIR_VAR in their environment; psutil's scans)
and its job directories."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
from pathlib import Path

import psutil

#: In the trainer's environment (and so its children's): its job directory.
#: A restarted agent finds what an earlier one left running by it.
JOB_DIR_VAR = "LORAFLEET_JOB_DIR"


def leftover_trainers(work_dir: Path) -> set[int]:
    """Processes an earlier agent with this work directory left running: the
    trainers (and whatever they started) whose LORAFLEET_JOB_DIR is under it."""
    prefix = f"{work_dir / 'jobs'}/"
    found: set[int] = set()
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        try:
            job_dir = proc.environ().get(JOB_DIR_VAR, "")
        except psutil.Error:  # gone, or another user's (the agent runs them as itself then)
            continue
        if job_dir.startswith(prefix):
            found.add(proc.pid)
    return found


def kill_leftover_trainers(work_dir: Path) -> list[int]:
    """SIGKILL what `leftover_trainers` finds; answers the pids."""
    pids = sorted(leftover_trainers(work_dir))
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return pids


def remove_job_dirs(work_dir: Path) -> list[str]:
    """Remove every job directory (at agent start: no job survives a restart)."""
    root = work_dir / "jobs"
    removed: list[str] = []
    if not root.is_dir():
        return removed
    for d in root.iterdir():
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d.name)
    return removed
