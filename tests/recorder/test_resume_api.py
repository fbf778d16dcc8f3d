"""resume_from and api.jobs.resume on a real nats-server and PostgreSQL, in raw
JSON: a clear error for each bad input, nothing changed; a checkpoint reported
by `store.jobs.artifact` is what a resume starts from."""

from __future__ import annotations

from typing import Any

from lorafleet.names import Names
from tests.recorder.test_service import Running, _spec, add_model, raw, running

__all__ = ["running"]  # the fixture, imported for these tests

N = Names()


async def moved(nc: Any, job_id: str, from_state: str, to_state: str, **kw: Any) -> dict[str, Any]:
    body = {"id": job_id, "from_state": from_state, "to_state": to_state, **kw}
    reply, _ = await raw(nc, N.store_transition, body)
    assert reply["applied"], reply
    return dict(reply["job"])


async def test_submit_refuses_a_resume_from_with_nothing_to_start_from(running: Running) -> None:
    nc = running.nc
    await add_model(nc)
    await add_model(nc, "other")
    bare, _ = await raw(nc, N.jobs_submit, _spec())
    for resume_from, word in (
        ("nope", "which does not exist"),
        (bare["id"], "stored neither a checkpoint nor an adapter"),
    ):
        err, _ = await raw(nc, N.jobs_submit, {**_spec(), "resume_from": resume_from})
        assert err["error"]["code"] == "bad_request", err
        assert err["error"]["field"] == "$.resume_from" and word in err["error"]["message"], err
    err, _ = await raw(nc, N.jobs_submit, {**_spec(), "max_attempts": 0})
    assert err["error"]["code"] == "bad_request" and "max_attempts" in err["error"]["field"]
    await moved(nc, bare["id"], "queued", "starting", node="n1")
    await raw(
        nc, N.store_artifact,
        {"id": bare["id"], "kind": "checkpoint", "size": 5, "sha256": "c" * 64,
         "step": 40, "attempt": 1, "object": f"{bare['id']}/checkpoint"},
    )  # fmt: skip
    err, _ = await raw(nc, N.jobs_submit, {**_spec(model="other"), "resume_from": bare["id"]})
    assert "trained model tiny, not other" in err["error"]["message"], err
    err, _ = await raw(nc, N.jobs_submit, {**_spec(), "resume_from": bare["id"]})
    assert "is still starting: start from it once it has ended" in err["error"]["message"], err
    await moved(nc, bare["id"], "starting", "failed")
    job, _ = await raw(nc, N.jobs_submit, {**_spec(), "resume_from": bare["id"], "max_attempts": 3})
    assert job["resume_from"] == bare["id"] and job["max_attempts"] == 3, job
    listed, _ = await raw(nc, N.jobs_list, {})
    assert len(listed["jobs"]) == 2  # only the good submit added one


async def test_resume_over_nats_refuses_clearly_and_then_queues(running: Running) -> None:
    nc = running.nc
    await add_model(nc)
    job, _ = await raw(nc, N.jobs_submit, {**_spec(), "node": "n1"})
    err, _ = await raw(nc, N.jobs_resume, {"id": "nope"})
    assert err["error"]["code"] == "not_found" and "no job nope" in err["error"]["message"]
    await moved(nc, job["id"], "queued", "starting", node="n1")
    running_job = await moved(nc, job["id"], "starting", "running")
    err, _ = await raw(nc, N.jobs_resume, {"id": job["id"]})
    assert err["error"]["code"] == "conflict" and "is running" in err["error"]["message"], err
    ended = await moved(nc, job["id"], "running", "cancelled", message="by hand")
    err, _ = await raw(nc, N.jobs_resume, {"id": job["id"]})
    assert err["error"]["code"] == "conflict", err
    assert "no checkpoint stored" in err["error"]["message"], err
    got, _ = await raw(nc, N.jobs_get, {"id": job["id"]})
    assert got == ended and got["updated_at"] != running_job["updated_at"]
    stored, _ = await raw(
        nc, N.store_artifact,
        {"id": job["id"], "kind": "checkpoint", "size": 5, "sha256": "c" * 64,
         "step": 7, "attempt": 1, "object": f"{job['id']}/checkpoint"},
    )  # fmt: skip
    assert stored["checkpoint"]["step"] == 7 and stored["state"] == "cancelled", stored
    resumed, _ = await raw(nc, N.jobs_resume, {"id": job["id"], "attempts": 2, "reason": "go"})
    assert resumed["state"] == "queued" and resumed["max_attempts"] == 3, resumed
    assert resumed["node"] == "n1" and "from the checkpoint at step 7" in resumed["message"]
    curve, _ = await raw(nc, N.jobs_curve, {"id": job["id"]})
    assert [e["to_state"] for e in curve["events"]][-2:] == ["cancelled", "queued"]
