"""Log lines are JSON with the fixed vocabulary, stamina's retries included."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest
import stamina
import stamina.instrumentation
import structlog

from lorafleet import log
from lorafleet.log import Event


@pytest.fixture
def lines() -> Iterator[io.StringIO]:
    out = io.StringIO()
    handlers, level = logging.root.handlers[:], logging.root.level
    log.configure("test", stream=out)
    try:
        yield out
    finally:
        logging.root.handlers[:], logging.root.level = handlers, level
        structlog.reset_defaults()
        structlog.contextvars.clear_contextvars()
        stamina.instrumentation.set_on_retry_hooks(None)


def test_a_generic_retry_is_logged_in_the_vocabulary(lines: io.StringIO) -> None:
    tries: list[int] = []

    @stamina.retry(on=ConnectionError, attempts=2, wait_initial=0, wait_jitter=0)
    def flaky() -> str:
        tries.append(1)
        if len(tries) == 1:
            raise ConnectionError("refused")
        return "ok"

    assert flaky() == "ok"
    [line] = [json.loads(x) for x in lines.getvalue().splitlines()]
    assert line["event"] == Event.RETRY_SCHEDULED
    assert line["service"] == "test" and line["level"] == "warning"
    assert "flaky" in line["message"] and "try 2" in line["message"]
    assert line["error"] == "ConnectionError('refused')"


def test_a_refused_report_of_either_kind_is_logged_with_the_same_fields(
    lines: io.StringIO,
) -> None:
    import datetime as dt

    from lorafleet_schemas.messages import Engine, ServingReport, ServingState, StatusReport

    t = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    status = StatusReport(job_id="j1", node="n1", attempt=1, seq=7, time=t)
    serving = ServingReport(
        job_id="j2", node="n2", engine="http://n2:8000/v1", engine_kind=Engine.VLLM, model="m",
        served_name="m-j2", sha256="0" * 64, state=ServingState.SERVED, seq=9, time=t,
    )  # fmt: skip
    log.reports_refused(log.get(), [(status, "not its node")])
    log.reports_refused(log.get(), [(serving, "no such job")], "serving report: ")
    got = [json.loads(x) for x in lines.getvalue().splitlines()]
    assert [{k: line[k] for k in ("event", "level", "job_id", "node", "seq", "message")}
            for line in got] == [
        {"event": "status.refused", "level": "warning", "job_id": "j1", "node": "n1",
         "seq": 7, "message": "not its node"},
        {"event": "status.refused", "level": "warning", "job_id": "j2", "node": "n2",
         "seq": 9, "message": "serving report: no such job"},
    ]  # fmt: skip
