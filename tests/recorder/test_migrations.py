"""tables.py and the Alembic migrations describe the same schema.

A fresh database is migrated with Alembic and compared with the tables'
metadata by Alembic's autogenerate (`compare_metadata`, types compared too),
on both backends: a column, table, index or type in one and not the other
fails here, before a query meets it in production.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, pool

from lorafleet_services.recorder.db import migrate, sync_url
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
            conn.execute(text("INSERT INTO loss_points VALUES ('r', 3, 1.4, NULL, NULL, NULL, 2)"))
        command.downgrade(config, "0003")
        with engine.begin() as conn:
            assert conn.execute(text("SELECT step, loss FROM loss_points")).all() == [(3, 1.5)]
    finally:
        engine.dispose()
