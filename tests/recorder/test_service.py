"""The recorder on a real nats-server and PostgreSQL, spoken to in raw JSON.

No project client here: requests are the bytes the `nats` CLI would send.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import nats
import nats.js.errors
import pytest
from nats.aio.client import Client

from lorafleet.names import Header, Names, dataset_object_name
from lorafleet.nats import _bus as bus
from lorafleet.nats.server import NatsServer
from lorafleet.settings import Settings
from lorafleet_services.recorder import db
from lorafleet_services.recorder.service import Recorder
from tests.eventually import eventually

N = Names()
QA = '{"q": "2+2?", "a": "4"}\n{"q": "capital of France?", "a": "Paris"}\n'


@dataclass
class Running:
    settings: Settings
    nc: Client  # a plain client, as any NATS user has
    recorder: Recorder


@pytest.fixture
async def running(settings: Settings, pg_url: str) -> AsyncIterator[Running]:
    s = settings.with_(database_url=pg_url)
    engine = db.create_engine(pg_url)
    rnc = await bus.connect(s, "recorder-under-test")
    await bus.ensure_layout(rnc.jetstream(), bus.layout_for(s))  # as runtime.serve does
    recorder = Recorder(s, rnc, engine)
    await recorder.start()
    nc = await nats.connect(s.nats_url)
    try:
        yield Running(s, nc, recorder)
    finally:
        await nc.close()
        await recorder.stop()  # disposes the engine too
        await bus.drain_quietly(rnc)


async def raw(nc: Client, subject: str, body: Any) -> tuple[dict[str, Any], dict[str, str]]:
    payload = body if isinstance(body, bytes) else json.dumps(body).encode()
    msg = await nc.request(subject, payload, timeout=10)
    return json.loads(msg.data), dict(msg.headers or {})


async def add_model(nc: Client, name: str = "tiny", engine: str = "vllm") -> dict[str, Any]:
    body, _ = await raw(nc, N.models_add, {"name": name, "engine": engine, "hf_repo": "org/tiny"})
    assert "error" not in body, body
    return body


async def test_submit_get_list_round_trip_raw_json(running: Running) -> None:
    nc = running.nc
    events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def on_event(msg: Any) -> None:
        await events.put(json.loads(msg.data))

    await nc.subscribe(N.all_job_events, cb=on_event)
    model = await add_model(nc)
    assert model["engine"] == "vllm" and model["hf_revision"] == "main"

    payload = b'{"model": "tiny", "gpu_memory_mib": 2048, "name": "first", "data": ' + json.dumps(
        QA
    ).encode() + b', "params": {"rank": 8, "max_steps": 5}}'  # fmt: skip
    job, headers = await raw(nc, N.jobs_submit, payload)
    assert Header.SERVICE_ERROR_CODE not in headers
    assert job["state"] == "queued" and job["records"] == 2 and job["node"] is None
    assert job["params"]["rank"] == 8 and job["params"]["max_steps"] == 5
    assert job["artifacts_expected"] == ["peft"]
    assert job["dataset"] == dataset_object_name(job["dataset_sha256"])
    import hashlib

    assert job["dataset_sha256"] == hashlib.sha256(QA.encode()).hexdigest()

    got, _ = await raw(nc, N.jobs_get, {"id": job["id"]})
    assert got == job
    second, _ = await raw(
        nc, N.jobs_submit, {"model": "tiny", "gpu_memory_mib": 1, "dataset": job["dataset"]}
    )
    assert second["dataset_sha256"] == job["dataset_sha256"] and second["records"] == 2
    listed, _ = await raw(nc, N.jobs_list, {})
    assert [j["id"] for j in listed["jobs"]] == [second["id"], job["id"]]
    listed, _ = await raw(nc, N.jobs_list, {"limit": 1, "oldest_first": True})
    assert [j["id"] for j in listed["jobs"]] == [job["id"]]
    listed, _ = await raw(nc, N.jobs_list, {"state": "running"})
    assert listed["jobs"] == []

    # Each submit published its job, after commit.
    seen = [await asyncio.wait_for(events.get(), 5) for _ in range(2)]
    assert [(e["kind"], e["job"]["id"]) for e in seen] == [
        ("state", job["id"]),
        ("state", second["id"]),
    ]
    # The data is in the bucket, as `nats object get` would read it.
    obs = await nc.jetstream().object_store(N.datasets_bucket)
    assert (await obs.get(job["dataset"])).data == QA.encode()


async def test_named_dataset(running: Running) -> None:
    nc = running.nc
    await add_model(nc, "gg", "llamacpp")
    obs = await nc.jetstream().object_store(N.datasets_bucket)
    chat = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
        ]
    }
    content = ("\n".join([json.dumps(chat)] * 500) + "\n").encode()
    await obs.put("chats.ndjson", content)
    job, _ = await raw(
        nc, N.jobs_submit, {"model": "gg", "gpu_memory_mib": 100, "dataset": "chats.ndjson"}
    )
    assert job["records"] == 500 and job["dataset"] == "chats.ndjson"
    assert job["artifacts_expected"] == ["peft", "gguf"]
    await obs.put("bad.ndjson", content + b'{"q": "no answer"}\n')
    err, headers = await raw(
        nc, N.jobs_submit, {"model": "gg", "gpu_memory_mib": 100, "dataset": "bad.ndjson"}
    )
    assert err["error"]["code"] == "bad_request" and err["error"]["field"] == "$.dataset"
    assert "line 501" in err["error"]["message"] and '"a"' in err["error"]["message"]
    assert headers[Header.SERVICE_ERROR_CODE] == "400"


def _spec(**kw: Any) -> dict[str, Any]:
    return {"model": "tiny", "gpu_memory_mib": 100, "data": QA, **kw}


#: (subject, body, code, field or None, a word the message must contain)
BAD: list[tuple[str, Any, str, str | None, str]] = [
    (N.jobs_submit, b"{not json", "bad_request", None, "JSON"),
    (N.jobs_submit, b"", "bad_request", None, "empty"),
    (N.jobs_submit, _spec(colour="red"), "bad_request", "$.colour", "remove it"),
    (N.jobs_submit, _spec(gpu_memory_mib=0), "bad_request", "$.gpu_memory_mib", ">"),
    (N.jobs_submit, _spec(gpu_memory_mib="lots"), "bad_request", "$.gpu_memory_mib", "int"),
    (N.jobs_submit, _spec(params={"rank": 0}), "bad_request", "$.params.rank", ">="),
    (N.jobs_submit, _spec(params={"learning_rate": 0}), "bad_request", "$.params.learning_rate", ">"),  # noqa: E501
    (N.jobs_submit, _spec(params={"epochs": 0}), "bad_request", "$.params.epochs", ">="),
    (N.jobs_submit, _spec(params={"rnak": 8}), "bad_request", "$.params.rnak", "unknown"),
    (N.jobs_submit, _spec(data=""), "bad_request", "$.data", "empty"),
    (N.jobs_submit, _spec(data=QA + "[1, 2]\n"), "bad_request", "$.data", "line 3"),
    (N.jobs_submit, _spec(data='{"q": "x", "a": "y", "z": 1}'), "bad_request", "$.data", '"z"'),
    (N.jobs_submit, _spec(dataset="x"), "bad_request", "$.data", "exactly one"),
    (N.jobs_submit, {"model": "tiny", "gpu_memory_mib": 5}, "bad_request", "$.data", "exactly one"),
    (N.jobs_submit, _spec(data=None, dataset="missing"), "not_found", "$.dataset", "missing"),
    (N.jobs_submit, _spec(model="nope"), "not_found", "$.model", "tiny"),
    (N.jobs_submit, _spec(node="a b"), "bad_request", "$.node", "match"),
    (N.jobs_get, {"id": "nope"}, "not_found", "$.id", "nope"),
    (N.jobs_get, {}, "bad_request", "$.id", "add it"),
    (N.jobs_get, b"[]", "bad_request", None, "object"),
    (N.jobs_list, {"limit": 0}, "bad_request", "$.limit", ">="),
    (N.jobs_list, {"state": "sleeping"}, "bad_request", "$.state", "queued, starting"),
    (N.jobs_list, {"states": ["queued", "zzz"]}, "bad_request", "$.states[1]", "cancelled"),
    (N.jobs_submit, _spec(params={"dtype": "fp8"}), "bad_request", "$.params.dtype", "auto, bf16"),
    (N.jobs_curve, {"id": "nope"}, "not_found", "$.id", "nope"),
    (N.models_add, {"name": "m", "engine": "vllm"}, "bad_request", "$.hf_repo", "local_dir"),
    (N.models_add, {"name": "m", "engine": "tgi", "hf_repo": "x"}, "bad_request", "$.engine", "vllm, llamacpp"),  # noqa: E501
    (N.models_add, {"name": "m", "engine": "vllm", "hf_repo": "x", "local_dir": "/m"}, "bad_request", "$.local_dir", "not both"),  # noqa: E501
    (N.models_add, {"name": "tiny", "engine": "vllm", "hf_repo": "x"}, "conflict", "$.name", "tiny"),  # noqa: E501
    (N.models_list, {"x": 1}, "bad_request", "$.x", "unknown"),
    (N.store_transition, {"id": "nope", "from_state": "queued", "to_state": "starting"}, "not_found", "$.id", "nope"),  # noqa: E501
    (N.store_transition, {"id": "j", "from_state": "queued", "to_state": "running"}, "conflict", "$.to_state", "starting"),  # noqa: E501
    (N.store_transition, {"id": "j", "from_state": "done", "to_state": "failed"}, "conflict", "$.to_state", "final"),  # noqa: E501
    (N.store_artifact, {"id": "nope", "kind": "peft", "size": 1, "sha256": "0" * 64}, "not_found", "$.id", "nope"),  # noqa: E501
    (N.store_artifact, {"id": "j", "kind": "peft", "size": 1, "sha256": "XYZ"}, "bad_request", "$.sha256", "match"),  # noqa: E501
]  # fmt: skip


async def test_every_endpoint_refuses_bad_input(running: Running) -> None:
    nc = running.nc
    await add_model(nc)
    for subject, body, code, field, word in BAD:
        err, headers = await raw(nc, subject, body)
        where = f"{subject} {body!r}"
        assert "error" in err, where
        assert err["error"]["code"] == code, (where, err)
        assert err["error"]["field"] == field, (where, err)
        assert word in err["error"]["message"], (where, err)
        assert Header.SERVICE_ERROR_CODE in headers, where
    # Nothing was written, and the service still answers.
    listed, _ = await raw(nc, N.jobs_list, {})
    assert listed["jobs"] == []
    models, _ = await raw(nc, N.models_list, {})
    assert [m["name"] for m in models["models"]] == ["tiny"]
    obs = await nc.jetstream().object_store(N.datasets_bucket)
    with pytest.raises(nats.js.errors.NotFoundError):
        await obs.list()  # no data was stored for a refused job
    job, _ = await raw(nc, N.jobs_submit, _spec())
    assert job["state"] == "queued"


def report(job_id: str, seq: int, **kw: Any) -> bytes:
    t = dt.datetime(2026, 1, 1, tzinfo=dt.UTC) + dt.timedelta(seconds=seq)
    return json.dumps(
        {"job_id": job_id, "node": "n1", "attempt": 1, "seq": seq, "time": t.isoformat(), **kw}
    ).encode()


async def wait_job(nc: Client, job_id: str, pred: Any, timeout_s: float = 30.0) -> dict[str, Any]:
    async def get() -> dict[str, Any]:
        job, _ = await raw(nc, N.jobs_get, {"id": job_id})
        return job

    return await eventually(
        get, f"job {job_id} to reach the condition", until=pred, timeout_s=timeout_s,
        interval_s=0.1,
    )  # fmt: skip


async def test_transitions_race_and_artifacts_over_nats(running: Running) -> None:
    nc = running.nc
    await add_model(nc, "gg", "llamacpp")
    job, _ = await raw(nc, N.jobs_submit, _spec(model="gg"))
    replies = await asyncio.gather(
        *(
            raw(
                nc,
                N.store_transition,
                {"id": job["id"], "from_state": "queued", "to_state": "starting", "node": f"n{i}"},
            )
            for i in range(4)
        )
    )
    assert sum(r["applied"] for r, _ in replies) == 1
    winner = next(r["job"]["node"] for r, _ in replies if r["applied"])
    assert all(r["job"]["state"] == "starting" for r, _ in replies)
    got, _ = await raw(nc, N.jobs_get, {"id": job["id"]})
    assert got["node"] == winner and got["attempt"] == 1
    for kind in ("peft", "gguf"):
        rec, _ = await raw(
            nc, N.store_artifact, {"id": job["id"], "kind": kind, "size": 9, "sha256": "a" * 64}
        )
        assert rec["state"] == "starting"
    await nc.jetstream().publish(
        N.status(winner, job["id"]),
        report(job["id"], 1, node=winner, state="uploading"),
    )
    done = await wait_job(nc, job["id"], lambda j: j["state"] == "done")
    assert done["finished_at"] is not None
    curve, _ = await raw(nc, N.jobs_curve, {"id": job["id"]})
    assert [e["to_state"] for e in curve["events"]] == ["queued", "starting", "uploading", "done"]


async def test_status_consumer_survives_server_restart(
    running: Running, nats_server: NatsServer
) -> None:
    nc = running.nc
    await add_model(nc)
    job, _ = await raw(nc, N.jobs_submit, _spec())
    jid = job["id"]
    applied, _ = await raw(
        nc,
        N.store_transition,
        {"id": jid, "from_state": "queued", "to_state": "starting", "node": "n1"},
    )
    assert applied["applied"]
    progress: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def on_event(msg: Any) -> None:
        await progress.put(json.loads(msg.data))

    await nc.subscribe(N.job_events(jid), cb=on_event)
    js = nc.jetstream()
    await js.publish(N.status("n1", jid), report(jid, 1, state="running"))
    await js.publish(N.status("n1", jid), b"this is not a report")
    for i in range(1, 11):
        await js.publish(N.status("n1", jid), report(jid, 1 + i, step=i, steps=20, loss=2.0 / i))
    await wait_job(nc, jid, lambda j: j["step"] == 10)
    event = await asyncio.wait_for(progress.get(), 5)
    assert event["job"]["id"] == jid and event["kind"] in ("state", "progress")

    await nats_server.restart()
    # The plain client reconnects too; publish the rest after the restart.
    js = nc.jetstream()
    await eventually(
        lambda: js.publish(N.status("n1", jid), report(jid, 11 + 1, step=11, steps=20, loss=0.2)),
        "a publish after the restart", timeout_s=10, interval_s=0.2, retry_on=(Exception,),
    )  # fmt: skip
    for i in range(12, 21):
        await js.publish(N.status("n1", jid), report(jid, 1 + i, step=i, steps=20, loss=2.0 / i))
    done = await wait_job(nc, jid, lambda j: j["step"] == 20)
    assert done["state"] == "running" and done["loss"] == pytest.approx(0.1)
    curve, _ = await raw(nc, N.jobs_curve, {"id": jid})
    assert [p["step"] for p in curve["points"]] == list(range(1, 21))


async def test_deleted_consumer_is_recreated_and_replay_changes_nothing(running: Running) -> None:
    nc = running.nc
    await add_model(nc)
    job, _ = await raw(nc, N.jobs_submit, _spec())
    jid = job["id"]
    await raw(
        nc,
        N.store_transition,
        {"id": jid, "from_state": "queued", "to_state": "starting", "node": "n1"},
    )
    js = nc.jetstream()
    await js.publish(N.status("n1", jid), report(jid, 1, state="running"))
    for i in range(1, 6):
        await js.publish(N.status("n1", jid), report(jid, 1 + i, step=i, steps=9, loss=1.0 / i))
    before = await wait_job(nc, jid, lambda j: j["step"] == 5)
    await js.delete_consumer(N.status_stream, N.recorder_consumer)
    await js.publish(N.status("n1", jid), report(jid, 7, step=6, steps=9, loss=0.1))
    after = await wait_job(nc, jid, lambda j: j["step"] == 6)
    assert after["state"] == "running" and after["updated_at"] > before["updated_at"]
    curve, _ = await raw(nc, N.jobs_curve, {"id": jid})
    assert [p["step"] for p in curve["points"]] == [1, 2, 3, 4, 5, 6]
    # The replayed "running" report made no second state change.
    assert [e["to_state"] for e in curve["events"]] == ["queued", "starting", "running"]


async def test_a_report_holding_a_nul_is_poison_and_the_rest_of_its_batch_applies(
    running: Running,
) -> None:
    """Found by tests/fuzz: PostgreSQL refuses a NUL in text, so a report
    with one failed its whole batch, redelivered for ever."""
    nc = running.nc
    await add_model(nc)
    job, _ = await raw(nc, N.jobs_submit, _spec())
    moved, _ = await raw(
        nc,
        N.store_transition,
        {"id": job["id"], "from_state": "queued", "to_state": "starting", "node": "n1"},
    )
    assert moved["applied"]
    js = nc.jetstream()
    await js.publish(N.status("n1", job["id"]), report(job["id"], 1, message="bad\u0000"))
    await js.publish(N.status("n1", job["id"]), report(job["id"], 2, state="running", step=3))
    got = await wait_job(nc, job["id"], lambda j: j["state"] == "running")
    assert got["step"] == 3 and "\x00" not in got["message"]
    info = await eventually(
        lambda: js.consumer_info(N.status_stream, N.recorder_consumer),
        "both reports acked",
        until=lambda i: i.num_pending == 0 and i.num_ack_pending == 0,
    )
    assert info.delivered.stream_seq >= 2
