"""The exit codes of every `lorafleet` command: one table, each code one
meaning. docs/cli.md prints it and `lorafleet --help` ends with it (both
checked against `MEANINGS` by tests/cli/test_exit_codes.py)."""

from __future__ import annotations

from enum import IntEnum


class Exit(IntEnum):
    OK = 0
    #: A request refused or not carried out; the one line says what to change.
    REFUSED = 1
    #: Click's own code for a malformed command line (click.UsageError.exit_code).
    USAGE = 2
    NOT_SERVED = 3
    JOB_FAILED = 4
    JOB_CANCELLED = 5
    UNREACHABLE = 6
    BAD_FILE = 7
    INTERRUPTED = 130


MEANINGS: dict[Exit, str] = {
    Exit.OK: "done: the command did what it says (`watch`: the job is done)",
    Exit.REFUSED: "refused: an unknown job or model, invalid data or parameters, a memory "
    "estimate the job does not fit, a job that cannot resume, a download whose sha256 "
    "differs, a missing extra (`lorafleet[train]`, `[plots]`); the line says what to change",
    Exit.USAGE: "usage: an unknown or missing option, a value of the wrong form "
    "(`--param rank=zero`), a bad setting (`LORAFLEET_LOG_FORMAT=pretty`)",
    Exit.NOT_SERVED: "(`watch --until-served`) the job is done but no engine serves its adapter",
    Exit.JOB_FAILED: "(`watch`, `submit --watch`) the job failed",
    Exit.JOB_CANCELLED: "(`watch`, `submit --watch`) the job was cancelled",
    Exit.UNREACHABLE: "nothing to talk to: no NATS server answered, no lorafleet service "
    "answered (`lorafleet recorder`: nor its database), or the connection ended before the "
    "watched job did",
    Exit.BAD_FILE: "a file named on the command line cannot be read or written, or is "
    "malformed (`--params`, `--data`, `--eval-data`, `--png`, `--out`, `--dir`, `--data-dir`)",
    Exit.INTERRUPTED: "interrupted (Ctrl-C)",
}


def markdown_table() -> str:
    """The table as docs/cli.md prints it."""
    rows = ["| code | meaning |", "| --- | --- |"]
    rows += [f"| {code.value} | {meaning} |" for code, meaning in MEANINGS.items()]
    return "\n".join(rows)


def help_epilog() -> str:
    """The table as `lorafleet --help` ends: one paragraph per code (Typer
    turns each paragraph into a line)."""
    lines = ["Exit codes, the same in every command:"]
    lines += [f"{code.value:>3}  {meaning.replace('`', '')}" for code, meaning in MEANINGS.items()]
    return "\n\n".join(lines)
