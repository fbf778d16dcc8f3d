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
