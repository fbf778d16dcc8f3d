"""The recorder process SIGKILLed while reports stream in: each report applied once."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from typing import Any

import nats
import psycopg
from sqlalchemy.engine import make_url

from lorafleet.names import Names
from lorafleet.settings import Settings
from tests.eventually import eventually
from tests.procs import ServiceProcess

N = Names()
STEPS = 400
QA = '{"q": "2+2?", "a": "4"}\n'


async def req(nc: Any, subject: str, body: dict[str, Any]) -> dict[str, Any]:
    msg = await nc.request(subject, json.dumps(body).encode(), timeout=10)
    out: dict[str, Any] = json.loads(msg.data)
    assert "error" not in out, out
    return out


def reports(job_id: str) -> list[bytes]:
    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)

    def one(seq: int, **kw: Any) -> bytes:
        body = {"job_id": job_id, "node": "n1", "attempt": 1, "seq": seq}
        body["time"] = (t0 + dt.timedelta(seconds=seq)).isoformat()
        return json.dumps({**body, **kw}).encode()

    out = [one(1, state="running")]
    for i in range(1, STEPS + 1):
        out.append(one(1 + i, step=i, steps=STEPS, loss=5.0 / i, peak_mib=100 + i % 50))
    out.append(one(STEPS + 2, state="uploading", message="delivering"))
    return out


async def test_sigkill_while_reports_stream_in(settings: Settings, pg_url: str) -> None:
    # Reports held by the killed process come back after 2 s, not 30.
    s = settings.with_(database_url=pg_url, recorder_ack_wait_s=2.0)
    proc = await ServiceProcess("lorafleet_services.recorder", s).start()
    nc = await nats.connect(s.nats_url)
    try:
        await req(nc, N.models_add, {"name": "tiny", "engine": "vllm", "hf_repo": "o/t"})
        jobs = []
        for _ in range(2):
            job = await req(nc, N.jobs_submit, {"model": "tiny", "gpu_memory_mib": 1, "data": QA})
            moved = await req(
                nc,
                N.store_transition,
                {"id": job["id"], "from_state": "queued", "to_state": "starting", "node": "n1"},
            )
            assert moved["applied"]
            jobs.append(job["id"])
        js = nc.jetstream()
        streams = [reports(j) for j in jobs]

        async def publish_all() -> None:
            for i in range(len(streams[0])):
                for j, stream in zip(jobs, streams, strict=True):
                    await js.publish(N.status("n1", j), stream[i])
                if i % 20 == 0:
                    await asyncio.sleep(0.01)

        publisher = asyncio.create_task(publish_all())
        # Kill it once it has applied some, while the rest still streams in.
        await eventually(
            lambda: req(nc, N.jobs_get, {"id": jobs[0]}), "the first job at step 40",
            until=lambda j: j["step"] >= 40, timeout_s=30, interval_s=0.02,
        )  # fmt: skip
        proc.kill()
        await proc.stop()
        assert not publisher.done(), "the publisher finished before the kill: make STEPS larger"
        await asyncio.sleep(0.5)
        proc = await ServiceProcess("lorafleet_services.recorder", s).start()
        await publisher

        # Reports the killed process had fetched come back after the ack wait.
        await eventually(
            lambda: js.consumer_info(N.status_stream, N.recorder_consumer),
            "every report applied and acked",
            until=lambda info: info.num_pending == 0 and info.num_ack_pending == 0,
            timeout_s=40, interval_s=0.2,
        )  # fmt: skip
        for job_id in jobs:
            got = await req(nc, N.jobs_get, {"id": job_id})
            assert got["state"] == "uploading" and got["step"] == STEPS, got
            assert got["peak_mib"] == 149 and got["message"] == "delivering"
            curve = await req(nc, N.jobs_curve, {"id": job_id})
            assert [p["step"] for p in curve["points"]] == list(range(1, STEPS + 1))
            # One event per state change: nothing was applied twice.
            assert [e["to_state"] for e in curve["events"]] == [
                "queued",
                "starting",
                "running",
                "uploading",
            ]
        # The high-water mark is the last report's.
        u = make_url(pg_url)
        with psycopg.connect(host=u.host, port=u.port, user=u.username, dbname=u.database) as c:
            rows = c.execute("SELECT last_seq FROM jobs ORDER BY id").fetchall()
        assert [r[0] for r in rows] == [STEPS + 2, STEPS + 2]
    finally:
        await nc.close()
        await proc.stop()


async def test_process_on_sqlite_default_poison_and_clean_stop(settings: Settings) -> None:
    """The embedded default: SQLite migrated at start; poison logged and acked; SIGTERM."""
    proc = await ServiceProcess("lorafleet_services.recorder", settings).start()
    nc = await nats.connect(settings.nats_url)
    try:
        await req(nc, N.models_add, {"name": "tiny", "engine": "llamacpp", "local_dir": "/m"})
        job = await req(nc, N.jobs_submit, {"model": "tiny", "gpu_memory_mib": 1, "data": QA})
        assert job["artifacts_expected"] == ["peft", "gguf"]
        js = nc.jetstream()
        await js.publish(N.status("n1", job["id"]), b'{"job_id": 1}')
        poison = await proc.wait_for_event("status.refused", timeout_s=10)
        assert poison["message"] == "poison" and "error" in poison
        await js.publish(N.status("n1", job["id"]), reports(job["id"])[1])
        await eventually(
            lambda: len(proc.events("status.refused")) >= 2, "the second status.refused",
            timeout_s=10,
        )  # fmt: skip
        refused = proc.events("status.refused")[-1]
        assert refused["job_id"] == job["id"] and "not placed" in refused["message"]
        await eventually(  # the recorder acks after it logs; the server takes acks in its time
            lambda: js.consumer_info(N.status_stream, N.recorder_consumer), "both acked",
            until=lambda i: i.num_ack_pending == 0, timeout_s=5,
        )  # fmt: skip
        assert proc.events("job.queued")[0]["job_id"] == job["id"]
    finally:
        await nc.close()
        code = await proc.stop()
    assert code == 0
    assert proc.events("service.stopped")
