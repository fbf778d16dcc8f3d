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
