"""A job's own evaluation set at submit, on both backends: stored and named
as the training data is, refused field by field by the same record rules,
and nothing stored for a refused job."""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator
from typing import Any

import nats
import pytest

from lorafleet.names import dataset_object_name
from lorafleet.nats import _bus as bus
from lorafleet.settings import Settings
from lorafleet_services.recorder import db
from lorafleet_services.recorder.service import Recorder
from tests.recorder.test_service import QA, N, Running, add_model, raw

HELD = '{"q": "3+3?", "a": "6"}\n{"q": "capital of Italy?", "a": "Rome"}\n{"q": "1+1?", "a": "2"}\n'


@pytest.fixture
async def running(settings: Settings, db_url: str) -> AsyncIterator[Running]:
    """The recorder on PostgreSQL and on SQLite (test_service's is PostgreSQL only)."""
    s = settings.with_(database_url=db_url)
    rnc = await bus.connect(s, "recorder-under-test")
    await bus.ensure_layout(rnc.jetstream(), bus.layout_for(s))
    recorder = Recorder(s, rnc, db.create_engine(db_url))
    await recorder.start()
    nc = await nats.connect(s.nats_url)
    try:
        yield Running(s, nc, recorder)
    finally:
        await nc.close()
        await recorder.stop()
        await bus.drain_quietly(rnc)


def _sha(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


async def test_an_evaluation_set_inline_or_named_is_stored_and_kept(running: Running) -> None:
    nc = running.nc
    await add_model(nc)
    obs = await nc.jetstream().object_store(N.datasets_bucket)

    job, _ = await raw(nc, N.jobs_submit, _spec(eval_data=HELD))
    assert "error" not in job, job
    assert job["eval_dataset"] == dataset_object_name(_sha(HELD))
    assert job["eval_dataset_sha256"] == _sha(HELD) and job["eval_records"] == 3
    assert job["records"] == 2 and job["dataset_sha256"] == _sha(QA)
    assert (await obs.get(job["eval_dataset"])).data == HELD.encode()
    got, _ = await raw(nc, N.jobs_get, {"id": job["id"]})
    assert got == job, "read back from the database as it was submitted"

    await obs.put("held.jsonl", HELD.encode())
    named, _ = await raw(nc, N.jobs_submit, _spec(eval_dataset="held.jsonl"))
    assert named["eval_dataset"] == "held.jsonl" and named["eval_records"] == 3
    assert named["eval_dataset_sha256"] == _sha(HELD)

    plain, _ = await raw(nc, N.jobs_submit, _spec())
    assert plain["eval_dataset"] is None and plain["eval_dataset_sha256"] is None
    assert plain["eval_records"] == 0


def _spec(**kw: Any) -> dict[str, Any]:
    return {"model": "tiny", "gpu_memory_mib": 100, "data": QA, **kw}


#: (body, code, field, words the message must contain)
BAD: list[tuple[dict[str, Any], str, str, list[str]]] = [
    (_spec(eval_data=""), "bad_request", "$.eval_data", ["eval_data:", "empty"]),
    (_spec(eval_data=HELD + "[1, 2]\n"), "bad_request", "$.eval_data", ["eval_data: line 4:", "JSON"]),  # noqa: E501
    (_spec(eval_data='{"q": "x", "a": "y", "z": 1}'), "bad_request", "$.eval_data", ["eval_data: line 1:", '"z"']),  # noqa: E501
    (_spec(eval_data='{"q": "x"}\n'), "bad_request", "$.eval_data", ["eval_data: line 1:", '"a"']),
    (_spec(eval_data=HELD, eval_dataset="held.jsonl"), "bad_request", "$.eval_data", ["not both"]),
    (_spec(eval_dataset="missing.jsonl"), "not_found", "$.eval_dataset", ["missing.jsonl", "eval_data"]),  # noqa: E501
    (_spec(eval_dataset="bad.jsonl"), "bad_request", "$.eval_dataset", ["eval_dataset: line 2:", '"q"']),  # noqa: E501
    (_spec(eval_dataset=dataset_object_name("0" * 64)), "conflict", "$.eval_dataset", ["overwritten"]),  # noqa: E501
    # The training data's errors still name its own field, the eval set being fine.
    (_spec(data=QA + "[1]\n", eval_data=HELD), "bad_request", "$.data", ["the training data: line 3:"]),  # noqa: E501
]  # fmt: skip


async def test_a_bad_evaluation_set_is_refused_naming_its_field(running: Running) -> None:
    nc = running.nc
    await add_model(nc)
    obs = await nc.jetstream().object_store(N.datasets_bucket)
    await obs.put("bad.jsonl", b'{"q": "a", "a": "b"}\n{"x": 1}\n')
    # Named by a sha256 its content does not have: someone overwrote it.
    await obs.put(dataset_object_name("0" * 64), HELD.encode())
    for body, code, field, words in BAD:
        err, _ = await raw(nc, N.jobs_submit, body)
        where = json.dumps(body)[:120]
        assert "error" in err, where
        assert (err["error"]["code"], err["error"]["field"]) == (code, field), (where, err)
        for word in words:
            assert word in err["error"]["message"], (where, word, err)
    listed, _ = await raw(nc, N.jobs_list, {})
    assert listed["jobs"] == []
    # A refused job stored nothing: its valid training data was not put either.
    names = {info.name for info in await obs.list()}
    assert names == {"bad.jsonl", dataset_object_name("0" * 64)}, names
