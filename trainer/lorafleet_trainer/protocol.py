"""The trainer's line protocol and exit codes: what the agent reads of it.

stdout carries one JSON object per line, its field "event" naming it
(`Event`); the agent decodes them as `TrainerLine` (lorafleet_schemas.messages):

    log         {"message", "level": "info"|"warning"}; the first names the
                process: "uid=... gid=... pid=..." (the stand-in's: "pid=...
                child_pid=...").
    state       {"state": "preparing"|"running"|"saving", "message"};
                preparing repeats while the records are tokenized
                ("tokenizing: N of M records").
    step        {"step", "steps", "loss", "learning_rate", "tokens_per_s",
                "eta_s", "peak_mib", "epoch"}, one per optimizer step: loss
                is the mean over the step's micro-batches, tokens_per_s counts
                real tokens (not padding), peak_mib is the process's peak so
                far: torch's peak reserved MiB and the CUDA context on a card,
                the peak RSS MiB on the CPU; epoch counts from 1.
    lengths     {"records_tokenized", "records_cut", "records_skipped", "min",
                "p50", "p95", "max", "mean"}, once, before the weights load:
                the token counts of the records tokenized by then.
    eval        {"step", "epoch", "eval_loss"}, after each epoch and at the end
                when eval_fraction > 0: the mean cross-entropy per answer token
                over the held-out records.
    checkpoint  {"step", "path", "epoch"}: a complete checkpoint of the state
                after optimizer step `step` is at `path` (lorafleet_trainer.layout).
                It may come a few steps after its step: the writing is off the
                training loop.
    done        {"adapter_dir", "base_dir", "summary"}
    error       {"message"}, before a failure's exit when it can.

Anything else (warnings, tracebacks, library chatter) goes to stderr. The exit
status is an `ExitCode`; each failure is raised as the exception that names
its code (`BadInputError`, ...) and turned into the code once, by `__main__`.
"""

from __future__ import annotations

import enum
import json
import os
import re
import signal
import sys
import threading
from typing import Any, TextIO


class Event(enum.StrEnum):
    """The "event" of a protocol line (fields: the module docstring)."""

    LOG = "log"
    STATE = "state"
    STEP = "step"
    LENGTHS = "lengths"
    EVAL = "eval"
    CHECKPOINT = "checkpoint"
    DONE = "done"
    ERROR = "error"


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


def is_environment_failure(e: BaseException) -> bool:
    """Whether an unexpected exception is the node's failure, not the job's
    (ExitCode.NODE_FAILED): a CUDA or driver error, but not an out of memory
    (the job's budget) nor a device-side assert (an index out of range: the
    job's data)."""
    text = str(e)
    if type(e).__name__ == "OutOfMemoryError" or "out of memory" in text:
        return False
    if "device-side assert" in text:
        return False
    return type(e).__name__ == "AcceleratorError" or bool(_ENVIRONMENT_ERROR.search(text))
