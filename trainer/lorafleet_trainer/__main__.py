"""python -m lorafleet_trainer job.json: the trainer's entry point.

The job file is read and checked first, with the standard library only: bad
input is refused in milliseconds, without torch. Then the job runs
(lorafleet_trainer.run) and every failure becomes its exit code here, after
an "error" line (lorafleet_trainer.protocol).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import traceback
import warnings
from pathlib import Path
from types import FrameType

from lorafleet_trainer.budget import failure_message
from lorafleet_trainer.jobfile import JobFile
from lorafleet_trainer.protocol import (
    KNOWN_FAILURES,
    Event,
    ExitCode,
    LineWriter,
    TerminatedError,
    is_environment_failure,
)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise TerminatedError()


def _yield_the_cores(lines: LineWriter) -> None:
    """A CPU job that yields to serving runs at SCHED_IDLE, set before torch
    makes its threads (they inherit it): the kernel gives a core to the engine
    the moment it has work. The pause file cannot: it is read between steps,
    after the engine's gauges show a request, which is after that request's
    first token. Costs the trainer nothing while the cores are otherwise idle."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except OSError as e:
        lines.log(
            f"the trainer's threads keep their CPU priority ({e}); it yields between steps only",
            "warning",
        )
        return
    lines.log("yielding to serving on the CPU: the trainer's threads run at SCHED_IDLE")


def main(argv: list[str]) -> int:
    lines = LineWriter.own_stdout()
    # Before anything: the agent's tests read who the trainer runs as.
    lines.emit(
        Event.LOG, message=f"uid={os.getuid()} gid={os.getgid()} pid={os.getpid()}", level="info"
    )
    signal.signal(signal.SIGTERM, _on_sigterm)
    # Libraries' deprecation notices among themselves (peft calling a renamed
    # transformers method) are nothing a job's owner can act on.
    warnings.filterwarnings("ignore", category=FutureWarning)
    if len(argv) != 2:
        lines.emit(Event.ERROR, message="usage: python -m lorafleet_trainer job.json")
        return ExitCode.BAD_INPUT
    job: JobFile | None = None
    try:
        job = JobFile.read(Path(argv[1]))
        if job.device == "cpu" and job.pause_path is not None:
            _yield_the_cores(lines)
        from lorafleet_trainer.run import run  # torch's side, for a job that parses

        return run(job, lines)
    except KNOWN_FAILURES as e:
        lines.emit(Event.ERROR, message=str(e))
        return e.exit_code
    except TerminatedError:
        lines.emit(Event.ERROR, message="stopped by SIGTERM")
        return ExitCode.STOPPED
    except Exception as e:
        traceback.print_exc(file=sys.stderr)
        with contextlib.suppress(Exception):
            lines.emit(Event.ERROR, message=failure_message(e, job))
        return ExitCode.NODE_FAILED if is_environment_failure(e) else ExitCode.JOB_FAILED


if __name__ == "__main__":
    sys.exit(main(sys.argv))
