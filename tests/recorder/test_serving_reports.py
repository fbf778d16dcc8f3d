"""Serving reports through the real status stream into a real recorder
(nats-server, PostgreSQL), read back in raw JSON as any NATS user would:
the record is upserted, a stale report changes nothing, the job event of
kind "serving" comes after commit, and `api.adapters.list` filters, many
jobs at once."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from lorafleet.names import Names
from lorafleet.nats import _bus as bus
from lorafleet_schemas.messages import ServingState
from tests.eventually import eventually
from tests.recorder.test_service import Running, _spec, add_model, raw, running, wait_job
from tests.recorder.test_service import report as status_report
from tests.recorder.test_servings import report

__all__ = ["running"]  # the fixture, imported for these tests

N = Names()


async def test_a_report_on_the_stream_becomes_a_record_and_an_event_after_commit(
    running: Running,
) -> None:
    nc, js = running.nc, running.nc.jetstream()
    await add_model(nc, "tiny-vllm")
    job, _ = await raw(nc, N.jobs_submit, _spec(model="tiny-vllm"))
    seen: asyncio.Queue[tuple[dict[str, Any], dict[str, Any]]] = asyncio.Queue()

    async def on_event(msg: Any) -> None:
        event = json.loads(msg.data)
        if event["kind"] == "serving":
            # What the recorder holds when the event arrives: committed already.
            listed, _ = await raw(nc, N.adapters_list, {"job_id": job["id"]})
            await seen.put((event, listed))

    await nc.subscribe(N.job_events(job["id"]), cb=on_event)
    loading = report(job["id"], 1, node="n1")
    await js.publish(N.serving_report("n1", job["id"]), bus.encode(loading))
    event, listed = await asyncio.wait_for(seen.get(), 10)
    assert event["job"]["id"] == job["id"] and event["job"]["state"] == "queued"
    assert event["serving"]["state"] == "loading" and event["serving"]["version"] == 1
    assert [a["state"] for a in listed["adapters"]] == ["loading"]

    served = report(job["id"], 2, ServingState.SERVED, node="n1", probe_error=0.001)
    await js.publish(N.serving_report("n1", job["id"]), bus.encode(served))
    event, listed = await asyncio.wait_for(seen.get(), 10)
    assert event["serving"]["state"] == "served" and event["serving"]["probe_error"] == 0.001
    assert listed["adapters"][0]["version"] == 2

    # Delivered again (an agent's retry): no change, no event; poison is dropped.
    await js.publish(N.serving_report("n1", job["id"]), bus.encode(loading))
    await js.publish(N.serving_report("n1", job["id"]), b"not a serving report")
    unloaded = report(job["id"], 3, ServingState.UNLOADED, node="n1", reason="unserve")
    await js.publish(N.serving_report("n1", job["id"]), bus.encode(unloaded))
    event, listed = await asyncio.wait_for(seen.get(), 10)
    assert event["serving"]["state"] == "unloaded" and event["serving"]["version"] == 3
    assert seen.empty()
    # The job's own status reports on the same stream still apply beside them.
    await raw(
        nc, N.store_transition,
        {"id": job["id"], "from_state": "queued", "to_state": "starting", "node": "n1"},
    )  # fmt: skip
    await js.publish(N.status("n1", job["id"]), status_report(job["id"], 1, state="running"))
    await wait_job(nc, job["id"], lambda j: j["state"] == "running")


async def test_adapters_list_filters_and_takes_many_jobs(running: Running) -> None:
    nc, js = running.nc, running.nc.jetstream()
    await add_model(nc, "tiny-vllm")
    jobs = [(await raw(nc, N.jobs_submit, _spec(model="tiny-vllm")))[0]["id"] for _ in range(3)]
    for seq, (job_id, node, state) in enumerate(
        [(jobs[0], "n1", ServingState.SERVED), (jobs[1], "n2", ServingState.REFUSED),
         (jobs[2], "n1", ServingState.SERVED)], start=1,
    ):  # fmt: skip
        await js.publish(
            N.serving_report(node, job_id), bus.encode(report(job_id, seq, state, node=node))
        )

    async def listed(body: dict[str, Any]) -> list[tuple[str, str]]:
        reply, _ = await raw(nc, N.adapters_list, body)
        assert "error" not in reply, reply
        return sorted((a["job_id"], a["node"]) for a in reply["adapters"])

    await eventually(lambda: listed({}), "three records", until=lambda r: len(r) == 3)
    assert await listed({"job_ids": [jobs[0], jobs[1]]}) == sorted(
        [(jobs[0], "n1"), (jobs[1], "n2")]
    )
    assert await listed({"job_id": jobs[2], "job_ids": [jobs[1]]}) == sorted(
        [(jobs[1], "n2"), (jobs[2], "n1")]
    )
    assert await listed({"node": "n1", "state": "served"}) == sorted(
        [(jobs[0], "n1"), (jobs[2], "n1")]
    )
    assert await listed({"model": "other"}) == []
    bad, _ = await raw(nc, N.adapters_list, {"state": "shining"})
    assert bad["error"]["code"] == "bad_request" and bad["error"]["field"] == "$.state", bad
