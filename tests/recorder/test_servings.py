"""Serving records on PostgreSQL and SQLite: a report makes or updates its
record, a report not newer than the record is stale, a report for no job is
refused, the list filters; and a job keeps its `serve` wish."""

from __future__ import annotations

import datetime as dt

from lorafleet_schemas.messages import (
    AdapterKey,
    Engine,
    JobRecord,
    JobSpec,
    ServingReport,
    ServingState,
)
from lorafleet_services.agent.serving.plan import ReportSeq
from lorafleet_services.recorder import servings, store
from lorafleet_services.recorder.db import Sessions
from tests.recorder.test_store import SHA, T0, new_job

ENGINE = "http://127.0.0.1:8000"


def report(
    job: JobRecord | str, seq: int, state: ServingState = ServingState.LOADING, **kw: object
) -> ServingReport:
    if "time" not in kw:
        kw["time"] = T0 + dt.timedelta(seconds=seq)
    fields: dict[str, object] = {
        "job_id": job if isinstance(job, str) else job.id,
        "node": "n1",
        "engine": ENGINE,
        "engine_kind": Engine.VLLM,
        "model": "tiny-vllm",
        "served_name": "j-abcdef012345",
        "sha256": "a" * 64,
        "state": state,
        "seq": seq,
        **kw,
    }
    return ServingReport(**fields)  # type: ignore[arg-type]


async def test_a_report_makes_the_record_and_a_newer_one_changes_it(models: Sessions) -> None:
    job = await new_job(models)
    first = await servings.apply_reports(models, [report(job, 1)])
    [made] = first.changes
    assert made.job.id == job.id and made.serving.state is ServingState.LOADING
    assert made.serving.version == 1 and made.serving.node == "n1"
    assert made.serving.engine == ENGINE and made.serving.sha256 == "a" * 64
    served = report(job, 2, ServingState.SERVED, probe_error=0.002)
    [changed] = (await servings.apply_reports(models, [served])).changes
    record = changed.serving
    assert record.state is ServingState.SERVED and record.probe_error == 0.002
    assert record.version == 2 and record.created_at == made.serving.created_at
    refused = report(job, 3, ServingState.REFUSED, reason="rank 32 > 16", lift="--max-lora-rank 32")
    await servings.apply_reports(models, [refused])
    [listed] = await servings.list_records(models, job_ids=[job.id])
    assert listed.state is ServingState.REFUSED and listed.version == 3
    assert (listed.reason, listed.lift) == ("rank 32 > 16", "--max-lora-rank 32")
    assert listed.probe_error is None  # each report says the whole record


async def test_seqs_as_an_agent_makes_them_are_stored(models: Sessions) -> None:
    """An agent's seq is its clock in microseconds, past 32 bits: PostgreSQL
    refused every such report until migration 0006 (the batch retried forever)."""
    job, seqs = await new_job(models), ReportSeq()
    first, second = seqs.next(), seqs.next()
    assert first > 2**31
    await servings.apply_reports(models, [report(job, first, time=T0)])
    [changed] = (
        await servings.apply_reports(models, [report(job, second, ServingState.SERVED, time=T0)])
    ).changes
    assert changed.serving.state is ServingState.SERVED
    assert (await servings.apply_reports(models, [report(job, first, time=T0)])).stale


async def test_a_report_not_newer_than_the_record_is_stale(models: Sessions) -> None:
    job = await new_job(models)
    # Out of order within one batch: the newest wins, the older is stale.
    result = await servings.apply_reports(
        models, [report(job, 5, ServingState.SERVED), report(job, 4, ServingState.FAILED)]
    )
    assert [r.seq for r in result.stale] == [4]
    [change] = result.changes
    assert change.serving.state is ServingState.SERVED and change.serving.version == 1
    for seq in (5, 3):  # delivered again, or late
        late = await servings.apply_reports(models, [report(job, seq, ServingState.UNLOADED)])
        assert late.changes == [] and [r.seq for r in late.stale] == [seq]
    [kept] = await servings.list_records(models)
    assert kept.state is ServingState.SERVED and kept.version == 1


async def test_a_report_for_no_job_is_refused_and_the_rest_apply(models: Sessions) -> None:
    job = await new_job(models)
    result = await servings.apply_reports(models, [report("nope", 1), report(job, 1)])
    assert [(r.job_id, why) for r, why in result.refused] == [("nope", "no job nope")]
    assert [c.serving.job_id for c in result.changes] == [job.id]


async def test_one_record_per_job_node_and_engine_and_the_list_filters(models: Sessions) -> None:
    a, b = await new_job(models), await new_job(models, "tiny-gguf")
    other = "http://127.0.0.1:8001"
    await servings.apply_reports(
        models,
        [
            report(a, 1, ServingState.SERVED),
            report(a, 2, engine=other),
            report(a, 3, ServingState.SERVED, node="n2"),
            report(b, 4, ServingState.RESTART_REQUIRED, model="tiny-gguf",
                   engine_kind=Engine.LLAMACPP),
        ],
    )  # fmt: skip
    everything = await servings.list_records(models)
    assert len(everything) == 4
    times = [r.updated_at for r in everything]
    assert times == sorted(times, reverse=True)  # newest change first
    by_job = await servings.list_records(models, job_ids=[b.id])
    assert [(r.job_id, r.state) for r in by_job] == [(b.id, ServingState.RESTART_REQUIRED)]
    assert len(await servings.list_records(models, job_ids=[a.id, b.id])) == 4
    assert {r.engine for r in await servings.list_records(models, node="n1", job_ids=[a.id])} == {
        ENGINE,
        other,
    }
    assert [r.job_id for r in await servings.list_records(models, model="tiny-gguf")] == [b.id]
    served = await servings.list_records(models, state=ServingState.SERVED)
    assert sorted(r.node for r in served) == ["n1", "n2"]
    assert len(await servings.list_records(models, limit=2)) == 2
    assert await servings.state_counts(models) == {
        "served": 2,
        "loading": 1,
        "restart_required": 1,
    }


async def test_every_record_pages_by_key_none_twice_while_they_change(models: Sessions) -> None:
    a, b = await new_job(models), await new_job(models)
    nodes = ("n1", "n2", "n3")
    await servings.apply_reports(
        models, [report(j, 10 * i + k, node=n) for i, j in enumerate((a, b)) for k, n in
                 enumerate(nodes)],
    )  # fmt: skip
    pages: list[list[tuple[str, str]]] = []
    after = AdapterKey(job_id="", node="", engine="")
    for seq in range(100, 110):
        page = await servings.list_records(models, limit=4, after=after)
        pages.append([(r.job_id, r.node) for r in page])
        # A record changed between pages: newest first, it would move up a page.
        await servings.apply_reports(models, [report(a, seq, ServingState.SERVED, node="n1")])
        if len(page) < 4:
            break
        after = AdapterKey(job_id=page[-1].job_id, node=page[-1].node, engine=page[-1].engine)
    listed = [key for page in pages for key in page]
    assert listed == sorted((j.id, n) for j in (a, b) for n in nodes), pages
    assert [len(p) for p in pages] == [4, 2]


async def test_a_job_keeps_its_serve_wish(models: Sessions) -> None:
    m = await store.get_model(models, "tiny-vllm")
    assert m is not None
    for wish in (None, False, True):
        spec = JobSpec(model="tiny-vllm", gpu_memory_mib=1000, data="x", serve=wish)
        job = await store.create_job(models, spec, m, f"sha256/{SHA}", SHA, 3)
        got = await store.get_job(models, job.id)
        assert job.serve is wish and got is not None and got.serve is wish


async def test_the_job_list_takes_many_ids_at_once(models: Sessions) -> None:
    a, b, c = [await new_job(models) for _ in range(3)]
    listed = await store.list_jobs(models, ids=[a.id, c.id, "nope"])
    assert sorted(j.id for j in listed) == sorted([a.id, c.id])
    assert b.id not in {j.id for j in listed} and len(await store.list_jobs(models)) == 3


async def test_a_report_wider_than_its_columns_is_refused_not_redelivered(
    models: Sessions,
) -> None:
    job = await new_job(models)
    wide = [
        report(job, 1, node="n" * 65),
        report(job, 2, engine="http://" + "e" * 600),
        report(job, 3, model="m" * 65, engine="http://other:1"),
    ]
    result = await servings.apply_reports(models, [*wide, report(job, 4)])
    assert sorted(why.split(" is ")[0] for _, why in result.refused) == ["engine", "model", "node"]
    assert [c.serving.state for c in result.changes] == [ServingState.LOADING]
