"""Child processes that do not outlive their parent.

A parent killed outright (SIGKILL, the OOM killer, a terminal closed under
a program that does not handle SIGHUP) leaves its children running, in
their own sessions: they keep their ports, stores and cards, and the next
start finds them in the way. Linux's parent-death signal ends that for any
program, Python or not: set in the child before it execs, the kernel sends
it when the parent dies. `die_with_parent` puts a short Python prelude in
front of a command line that does so; it costs one interpreter start
(about 20 ms) per child. The prelude uses the standard library only, so it
runs in any Python (the trainer's is the engine's).

"The parent" is the thread that started the child: start children from
the event loop's thread, as asyncio's subprocesses are.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence

#: argv: parent pid, signal number, the command line. prctl's setting
#: survives the exec; PR_SET_PDEATHSIG is 1. A parent already gone before
#: the prctl took effect is caught by the ppid check.
PRELUDE = (
    "import ctypes, os, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, int(sys.argv[2]))\n"
    "if os.getppid() != int(sys.argv[1]): os._exit(137)\n"
    "os.execvp(sys.argv[3], sys.argv[3:])"
)


def die_with_parent(
    argv: Sequence[str], sig: signal.Signals = signal.SIGTERM, python: str = sys.executable
) -> list[str]:
    """`argv`, run so that it gets `sig` when this process dies; `python` runs the prelude."""
    return [python, "-c", PRELUDE, str(os.getpid()), str(int(sig)), *argv]
