"""The trainer's line protocol and exit codes: what the agent reads of it.

stdout carries one JSON object per line, its field "event" naming it
(`Event`: log, state, step, lengths, eval, checkpoint, done, error); the
agent decodes them as `TrainerLine`, whose Structs
(lorafleet_schemas.messages.trainer_lines) say what each field means. The
trainer cannot import them (it runs in the engine's Python), so the event
names are here. Anything else (warnings, tracebacks, library chatter) goes
to stderr. The exit status is an `ExitCode`; each failure is raised as the
exception that names its code (`BadInputError`, ...) and turned into the
code once, by `__main__`.

The other way, the agent asks the trainer to yield to the engine's users
through a pause file (`PauseGate`): while it exists the trainer waits
between two optimizer steps (never inside one), with a "yield" line when
it stops and when it goes on.
"""

from __future__ import annotations

import enum
import json
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO


class Event(enum.StrEnum):
    """The "event" of a protocol line (its fields: lorafleet_schemas.messages.trainer_lines)."""

    LOG = "log"
    STATE = "state"
    STEP = "step"
    LENGTHS = "lengths"
    EVAL = "eval"
    CHECKPOINT = "checkpoint"
    DONE = "done"
    ERROR = "error"
    YIELD = "yield"


class ExitCode(enum.IntEnum):
    """The trainer's exit status."""

    #: The adapter is saved, after a "done" line.
    DONE = 0
    #: A failure of the job's own: a diverging loss, the base not on the Hub,
    #: an exception in training (its type is named), an out of memory (of its
    #: budget: a retry would fail the same way).
    JOB_FAILED = 1
    #: Bad input: parameters, data, the job file, a resume that does not fit
    #: the job; the error line names what to change.
    BAD_INPUT = 2
    #: A failure of the node, not the job's: a CUDA or driver error that is not
    #: an out of memory (`is_environment_failure`), no card where the agent
    #: chose one, the base not in the node's cache (offline), an OSError
    #: writing a checkpoint or the adapter. The job may be retried elsewhere.
    NODE_FAILED = 3
    #: Stopped by SIGTERM (128 + 15, as a shell reports it).
    STOPPED = 128 + signal.SIGTERM


class BadInputError(Exception):
    """The job file, its parameters or its data are wrong."""

    exit_code = ExitCode.BAD_INPUT


class TrainingFailureError(Exception):
    """Not the input's fault (a diverging loss, a base the Hub lacks): the
    message shown as it is."""

    exit_code = ExitCode.JOB_FAILED


class EnvironmentFailureError(Exception):
    """Not the job's fault: the node failed it (its card or driver, the disk a
    checkpoint goes to); the job may be retried elsewhere."""

    exit_code = ExitCode.NODE_FAILED


class TerminatedError(BaseException):
    """SIGTERM arrived: stop now."""

    exit_code = ExitCode.STOPPED


#: A failure with an exit code of its own: its message is the error line.
KNOWN_FAILURES = (BadInputError, TrainingFailureError, EnvironmentFailureError)


class LineWriter:
    """Writes protocol lines to one stream, a line at a time (the checkpoint
    writer's thread prints its lines too), flushed: the agent reads them live."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._lock = threading.Lock()

    @classmethod
    def own_stdout(cls) -> LineWriter:
        """A writer on fd 1, which from now on carries protocol lines only:
        anything else (a library's print, C code writing to fd 1) goes to stderr."""
        sys.stdout.flush()
        out = os.fdopen(os.dup(1), "w", encoding="utf-8", buffering=1)
        os.dup2(2, 1)
        sys.stdout = sys.stderr
        return cls(out)

    def emit(self, event: Event, **fields: Any) -> None:
        """Print one protocol line."""
        fields["event"] = str(event)
        line = json.dumps(fields, separators=(",", ":"), allow_nan=False) + "\n"
        with self._lock:
            self._out.write(line)
            self._out.flush()

    def log(self, message: str, level: str = "info") -> None:
        """A "log" line, also on stderr for a person reading the job's output."""
        self.emit(Event.LOG, message=message, level=level)
        print(f"[trainer] {level}: {message}", file=sys.stderr, flush=True)


#: A CUDA or driver error in an exception's text: the node's card failed the
#: job (an ECC error, a card fallen off the bus, a driver gone), not the job.
_ENVIRONMENT_ERROR = re.compile(
    r"CUDA error|CUDA driver|cuDNN error|CUBLAS_STATUS|CUSOLVER_STATUS|NCCL error|"
    r"\bECC\b|no CUDA-capable device|CUDA-capable device\(s\) is/are busy"
)


def is_out_of_memory(e: BaseException) -> bool:
    """Whether `e` is torch's out-of-memory error of a card (its allocator's
    cap reached: the job's budget, or the card full)."""
    return type(e).__name__ == "OutOfMemoryError"


def is_environment_failure(e: BaseException) -> bool:
    """Whether an unexpected exception is the node's failure, not the job's
    (ExitCode.NODE_FAILED): a CUDA or driver error, but not an out of memory
    (the job's budget) nor a device-side assert (an index out of range: the
    job's data)."""
    text = str(e)
    if is_out_of_memory(e) or "out of memory" in text:
        return False
    if "device-side assert" in text:
        return False
    return type(e).__name__ == "AcceleratorError" or bool(_ENVIRONMENT_ERROR.search(text))


class CheckpointAsks:
    """The agent asks for a checkpoint after the next step (a node drained
    with its training moved: the job resumes elsewhere from it) by writing a
    token it has not written before into the file at `path`. The trainer
    only reads it (it may run as another user, in a directory it cannot
    change), so a token is one ask: the same token again is none. An open()
    a step; None: never asked."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.seen = ""

    def asked(self) -> bool:
        if self.path is None:
            return False
        try:
            token = self.path.read_text(encoding="utf-8", errors="replace").strip()
        except OSError:
            return False
        if not token or token == self.seen:
            return False
        self.seen = token
        return True


#: Seconds between two looks at the pause file while paused: the time a
#: resume may take to be seen, for a stat() each (microseconds).
PAUSE_POLL_S = 0.02
#: Seconds a pause file may go untouched before the trainer takes it for
#: stale and goes on: the agent touches it while it holds the pause, so a
#: pause never outlives the agent that asked for it.
PAUSE_LEASE_S = 30.0


class PauseGate:
    """The trainer's side of yielding: `wait(step)` between two optimizer
    steps returns at once without a pause file (one stat()); with one it
    says so in a "yield" line (paused, why: the file's text) and waits until
    the file goes or is stale, then answers the seconds it waited. Paused
    time is no one's step time: the loop leaves it out of tokens/s."""

    def __init__(
        self,
        path: Path,
        lines: LineWriter,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self.lines = lines
        self.sleep = sleep
        self.clock = clock

    def _held(self) -> bool:
        try:
            age_s = time.time() - self.path.stat().st_mtime
        except OSError:
            return False
        return age_s < PAUSE_LEASE_S

    def wait(self, step: int) -> float:
        if not self._held():
            return 0.0
        try:
            cause = self.path.read_text(encoding="utf-8", errors="replace").strip()[:200]
        except OSError:
            cause = ""
        t0 = self.clock()
        self.lines.emit(Event.YIELD, state="paused", step=step, cause=cause)
        while self._held():
            self.sleep(PAUSE_POLL_S)
        paused_s = self.clock() - t0
        self.lines.emit(Event.YIELD, state="resumed", step=step, paused_s=round(paused_s, 3))
        return paused_s
