"""A node's wall clock stepped forward or back, as NTP or an operator steps
it, for the processes of that node only (the nemesis's `clock.step`).

`clock_step.c`, preloaded into each process the node starts (`env()`; its
children inherit it), adds the seconds in the node's clock file to what
CLOCK_REALTIME, gettimeofday() and time() answer; the monotonic clock stays,
as a real step leaves it. A process sees a new offset within READ_EVERY_S.
libfaketime would do the same, but the release Debian 12 ships (0.9.10)
fails every Python sleep with EINVAL once the monotonic clock is left alone
(DONT_FAKE_MONOTONIC=1), and a step of the monotonic clock is no real fault.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from tests.control_file import write_control

SOURCE = Path(__file__).with_name("clock_step.c")
#: Seconds a process may still read the old offset after `set()`.
READ_EVERY_S = 1.0


def unavailable() -> str | None:
    """Why the library cannot be built here (None: it can)."""
    return None if shutil.which("cc") else "no C compiler (cc) to build tests/clock_step.c"


def build(directory: Path) -> Path:
    """The library, compiled into `directory` (a fraction of a second)."""
    directory.mkdir(parents=True, exist_ok=True)
    library = directory / "libclockstep.so"
    subprocess.run(
        ["cc", "-shared", "-fPIC", "-O2", "-o", str(library), str(SOURCE), "-ldl"],
        check=True, capture_output=True,
    )  # fmt: skip
    return library


class NodeClock:
    """One node's clock file: `env()` for its processes, `set()` to step it."""

    def __init__(self, library: Path, path: Path) -> None:
        self.library = library
        self.path = path
        self.offset_s = 0.0
        self.set(0.0)

    def env(self) -> dict[str, str]:
        """(No LORAFLEET_ name: the agent passes its stand-in trainer none.)"""
        preload = " ".join(p for p in (str(self.library), os.environ.get("LD_PRELOAD")) if p)
        return {"LD_PRELOAD": preload, "CLOCK_STEP_OFFSET_FILE": str(self.path)}

    def set(self, offset_s: float) -> None:
        """The node's clock `offset_s` from the host's from now on (0: in step)."""
        write_control(self.path, f"{offset_s:.3f}\n")
        self.offset_s = offset_s
