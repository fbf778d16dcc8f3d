"""models.py and the Alembic migrations describe the same schema.

A fresh database is migrated with Alembic and compared with the models'
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
from lorafleet_services.recorder.models import Base
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
    """What autogenerate would write to make the database at `url` match models.py."""
    engine = create_engine(sync_url(url), poolclass=pool.NullPool)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True})
            return list(compare_metadata(context, Base.metadata))
    finally:
        engine.dispose()


def test_models_and_migrations_describe_the_same_schema(migrated_url: str) -> None:
    differences = schema_differences(migrated_url)
    assert differences == [], (
        "models.py and the migrations differ; write a migration (or fix the model):\n"
        + "\n".join(map(repr, differences))
    )
