"""Console log lines (a terminal) and JSON log lines (anything else) carry the
same events with the same fields; LORAFLEET_LOG_FORMAT overrides the guess."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import re
import sys
import threading
from collections.abc import Iterator

import pytest
import stamina.instrumentation
import structlog

from lorafleet import log
from lorafleet.log import Event
from lorafleet.settings import Settings
from lorafleet_services.stack import ServiceProcess

EVENTS = [
    (Event.JOB_STATE, {"job_id": "j1", "node": "gpu-1", "state": "running", "message": "go"}),
    (Event.JOB_PROGRESS, {"job_id": "j1", "step": 3, "steps": 10, "loss": 1.25, "peak_mib": 512}),
    (Event.NODE_LOST, {"node": "gpu-2", "message": "no heartbeat for 3 s"}),
]


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    handlers, level = logging.root.handlers[:], logging.root.level
    yield
    logging.root.handlers[:], logging.root.level = handlers, level
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()
    stamina.instrumentation.set_on_retry_hooks(None)


def write(stream: io.StringIO) -> list[str]:
    log.configure("scheduler", stream=stream)
    logger = log.get()
    for name, fields in EVENTS:
        logger.info(name, **fields)
    return stream.getvalue().splitlines()


def test_console_and_json_lines_carry_the_same_events_and_fields() -> None:
    json_lines = [json.loads(line) for line in write(io.StringIO())]
    console_lines = [_plain(line) for line in write(Tty())]
    assert len(console_lines) == len(json_lines) == len(EVENTS)
    for obj, line, (name, fields) in zip(json_lines, console_lines, EVENTS, strict=True):
        assert obj["event"] == name and obj["service"] == "scheduler"
        assert {k: obj[k] for k in fields} == fields
        assert re.match(
            rf"\d\d:\d\d:\d\d\.\d{{3}}Z \[info\s*\] {re.escape(name)}\s+\[scheduler\]", line
        )
        for key, value in fields.items():
            assert f"{key}={value!r}" in line or f"{key}={value}" in line, line
    # A child's JSON line, rendered for a person (`lorafleet up`), reads the same.
    out = io.StringIO()
    echo = log.ConsoleLines(out)
    echo.write(write(io.StringIO())[0] + "\nnot a log line\n")
    rendered, passed = out.getvalue().splitlines()
    assert rendered.split(" ", 1)[1] == console_lines[0].split(" ", 1)[1]
    assert passed == "not a log line"


def test_the_format_follows_the_terminal_unless_told() -> None:
    assert log.log_format(Tty(), env={}) == "console"
    assert log.log_format(io.StringIO(), env={}) == "json"
    assert log.log_format(Tty(), env={log.LOG_FORMAT_ENV: "json"}) == "json"
    assert log.log_format(io.StringIO(), env={log.LOG_FORMAT_ENV: "Console"}) == "console"
    with pytest.raises(log.LogFormatError, match="set it to json or console"):
        log.log_format(io.StringIO(), env={log.LOG_FORMAT_ENV: "pretty"})


def _plain(line: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", line)


class Stuck(io.StringIO):
    """A terminal that takes nothing until `go` is set (each write waits,
    at most STUCK_S seconds: a test that breaks the rule ends, failing)."""

    def __init__(self) -> None:
        super().__init__()
        self.go, self.entered = threading.Event(), threading.Event()

    def write(self, text: str) -> int:
        self.entered.set()
        self.go.wait(STUCK_S)
        return super().write(text)


#: Seconds a Stuck terminal holds each write at most.
STUCK_S = 20.0


def test_background_lines_never_wait_on_a_terminal_that_falls_behind() -> None:
    out = Stuck()
    lines = log.BackgroundLines(out, max_lines=3)
    lines.write("line 0\n")
    assert out.entered.wait(5)  # the thread holds line 0, stuck in the terminal

    def write_more() -> None:
        for i in range(1, 10):
            lines.write(f"line {i}\n")

    writer = threading.Thread(target=write_more)
    writer.start()
    writer.join(5)
    assert not writer.is_alive(), "a write waited on the stuck terminal"
    out.go.set()
    lines.close()
    assert out.getvalue().splitlines() == [
        "line 0", "... 6 log lines dropped: the terminal fell behind",
        "line 1", "line 2", "line 3",
    ]  # fmt: skip


class Flood(ServiceProcess):
    """A child that says it started, then logs LINES lines and exits."""

    LINES = 20_000

    def command(self) -> list[str]:
        script = (
            "import json, sys; print(json.dumps({'event': 'service.started'}), file=sys.stderr); "
            f"[print('x' * 200, file=sys.stderr) for _ in range({self.LINES})]"
        )
        return [sys.executable, "-c", script]


async def test_a_child_logging_to_a_stuck_terminal_goes_on() -> None:
    """`lorafleet up` copies its children's lines to the terminal: a stuck
    one filled their log pipes and stalled them (an agent's heartbeats
    stopped and its node was judged lost). 4 MB of lines pass a terminal
    that takes none."""
    out = Stuck()
    echo = log.BackgroundLines(out, max_lines=100)
    child = Flood("flood", Settings(), echo=echo, keep_lines=50)
    await child.start()
    assert child.proc is not None
    assert await asyncio.wait_for(child.proc.wait(), STUCK_S / 2) == 0
    await child.stop()
    assert len(child.raw) <= 2 * 50  # a long-running child's lines, bounded
    out.go.set()
    echo.close()
    assert "log lines dropped" in out.getvalue()
