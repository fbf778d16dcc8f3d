"""tables.py and the Alembic migrations describe the same schema.

A fresh database is migrated with Alembic and compared with the tables'
metadata by Alembic's autogenerate (`compare_metadata`, types compared too),
on both backends: a column, table, index or type in one and not the other
fails here, before a query meets it in production.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, pool

from lorafleet_services.recorder.db import HEAD_REVISION, migrate, sync_url
from lorafleet_services.recorder.tables import METADATA
from tests.pg import throwaway_database


@pytest.fixture(params=["postgresql", "sqlite"])
def migrated_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database migrated by Alembic just now (not the session's template copy)."""
    if request.param == "postgresql":
        with throwaway_database("lorafleet_test_migrations") as url:
            yield url
    else:
        url = f"sqlite+aiosqlite:///{tmp_path / 'migrated.db'}"
        migrate(url)
        yield url


def schema_differences(url: str) -> list[Any]:
    """What autogenerate would write to make the database at `url` match tables.py."""
    engine = create_engine(sync_url(url), poolclass=pool.NullPool)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True})
            return list(compare_metadata(context, METADATA))
    finally:
        engine.dispose()


def test_models_and_migrations_describe_the_same_schema(migrated_url: str) -> None:
    differences = schema_differences(migrated_url)
    assert differences == [], (
        "tables.py and the migrations differ; write a migration (or fix the table):\n"
        + "\n".join(map(repr, differences))
    )


def test_0004_keeps_the_jobs_and_points_from_before_and_goes_back(tmp_path: Path) -> None:
    from alembic import command
    from sqlalchemy import text

    from lorafleet_services.recorder.db import alembic_config

    url = f"sqlite+aiosqlite:///{tmp_path / 'old.db'}"
    config = alembic_config(url)
    command.upgrade(config, "0003")
    engine = create_engine(sync_url(url), poolclass=pool.NullPool)
    cols = (
        "id, name, model, engine, node, gpu_memory_mib, dataset, dataset_sha256, records, "
        "params, state, message, step, steps, peak_mib, attempt, last_seq, field_seqs, "
        "artifacts_expected, artifacts_stored, version, created_at, updated_at"
    )
    try:
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO models VALUES ('m', 'vllm', NULL, 'main', '/m', '', "
                              "'2026-01-01 00:00:00', NULL)"))  # fmt: skip
            for job_id, node, state in (("q", "n1", "queued"), ("r", "n2", "running")):
                conn.execute(
                    text(f"INSERT INTO jobs ({cols}) VALUES (:id, '', 'm', 'vllm', :node, 1, "
                         "'d', 'x', 1, '{}', :state, '', 3, 9, 0, 1, 0, '{}', '[\"peft\"]', "
                         "'[]', 1, '2026-01-01 00:00:00', '2026-01-01 00:00:00')"),
                    {"id": job_id, "node": node, "state": state},
                )  # fmt: skip
            conn.execute(text("INSERT INTO loss_points VALUES ('r', 3, 1.5, NULL, NULL, NULL)"))
        command.upgrade(config, "head")
        with engine.begin() as conn:
            jobs = conn.execute(
                text("SELECT id, max_attempts, requested_node FROM jobs ORDER BY id")
            ).all()
            assert [tuple(j) for j in jobs] == [("q", 1, "n1"), ("r", 1, None)]
            assert conn.execute(text("SELECT step, attempt FROM loss_points")).all() == [(3, 1)]
            # Another attempt's point at the same step now fits.
            conn.execute(text("INSERT INTO loss_points (job_id, step, loss, attempt) "
                              "VALUES ('r', 3, 1.4, 2)"))  # fmt: skip
        command.downgrade(config, "0003")
        with engine.begin() as conn:
            assert conn.execute(text("SELECT step, loss FROM loss_points")).all() == [(3, 1.5)]
    finally:
        engine.dispose()


def test_head_revision_is_alembics_head_and_a_database_at_it_is_left_alone(
    tmp_path: Path,
) -> None:
    from alembic import command
    from alembic.script import ScriptDirectory

    from lorafleet_services.recorder.db import HEAD_REVISION, alembic_config, revision

    url = f"sqlite+aiosqlite:///{tmp_path / 'head.db'}"
    config = alembic_config(url)
    assert ScriptDirectory.from_config(config).get_current_head() == HEAD_REVISION, (
        "a new migration: set db.HEAD_REVISION to its revision"
    )
    assert revision(url) is None
    command.upgrade(config, "0003")
    assert revision(url) == "0003"
    migrate(url)
    assert revision(url) == HEAD_REVISION
    # At head, migrate runs nothing: a schema of 0003 stamped as head stays 0003.
    command.downgrade(config, "0003")
    command.stamp(config, HEAD_REVISION)
    migrate(url)
    engine = create_engine(sync_url(url), poolclass=pool.NullPool)
    try:
        with engine.connect() as conn:
            columns = [row[1] for row in conn.exec_driver_sql("PRAGMA table_info(jobs)")]
    finally:
        engine.dispose()
    assert "max_attempts" not in columns


#: What each recorder's migration runs in its own process (Alembic's
#: `context` is one per process): ready once imported, then it migrates on a
#: line from stdin, so that both start at the same instant.
_MIGRATE_ON_GO = """
import sys
from lorafleet_services.recorder.db import migrate
print("ready", flush=True)
sys.stdin.readline()
migrate(sys.argv[1])
"""


def migrate_at_once(url: str, count: int) -> list[subprocess.CompletedProcess[str]]:
    """`count` processes migrate the database at `url`, released together."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _MIGRATE_ON_GO, url],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(count)
    ]
    for proc in procs:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    done = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


def version_rows(url: str) -> list[str]:
    engine = create_engine(sync_url(url), poolclass=pool.NullPool)
    try:
        with engine.connect() as conn:
            return [r[0] for r in conn.exec_driver_sql("SELECT version_num FROM alembic_version")]
    finally:
        engine.dispose()


def test_two_recorders_migrating_one_empty_postgresql_at_once_both_succeed() -> None:
    """The advisory lock in migrations/env.py: one migrates, the other waits and
    finds the schema at head (without the lock one fails creating
    alembic_version, 3 runs in 3)."""
    with throwaway_database("lorafleet_test_migrate_race", migrate=False) as url:
        for result in migrate_at_once(url, 2):
            assert result.returncode == 0, result.stderr[-2000:]
        assert version_rows(url) == [HEAD_REVISION]
        assert schema_differences(url) == []


def test_sqlite_migrates_alone(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'alone.db'}"
    (result,) = migrate_at_once(url, 1)
    assert result.returncode == 0, result.stderr[-2000:]
    assert version_rows(url) == [HEAD_REVISION]
