"""Throwaway PostgreSQL databases for tests and benchmarks (127.0.0.1:5432, trust auth)."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg

#: Where CREATE/DROP DATABASE run; LORAFLEET_TEST_PG_ADMIN overrides it.
PG_ADMIN_DSN = os.environ.get(
    "LORAFLEET_TEST_PG_ADMIN", "host=127.0.0.1 port=5432 user=postgres dbname=postgres"
)


@contextmanager
def throwaway_database(
    prefix: str = "lorafleet_test", admin_dsn: str = PG_ADMIN_DSN, migrate: bool = True
) -> Iterator[str]:
    """A new database, migrated with Alembic unless `migrate` is False; its
    SQLAlchemy URL while the block runs; dropped (connections forced off) after."""
    name = f"{prefix}_{secrets.token_hex(6)}"
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
        if migrate:
            from lorafleet_services.recorder.db import migrate as run_migrations

            run_migrations(url)
        yield url
    finally:
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
