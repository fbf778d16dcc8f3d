"""Alembic environment for the recorder's schema (run by db.migrate)."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, pool

#: Any constant: concurrent recorders starting on one PostgreSQL database
#: take this advisory lock so only one migrates at a time (without it the
#: second fails creating alembic_version: tests/recorder/test_migrations.py).
#: It is server-wide: migrations of other databases on the server wait too.
_PG_MIGRATION_LOCK = 0x10AF1EE7


def run_migrations_online() -> None:
    url = context.config.get_main_option("sqlalchemy.url")
    if url is None:
        raise RuntimeError("no sqlalchemy.url: run the migrations through db.migrate(url)")
    engine = create_engine(url, poolclass=pool.NullPool)
    with engine.connect() as connection:
        is_sqlite = connection.dialect.name == "sqlite"
        if connection.dialect.name == "postgresql":
            connection.exec_driver_sql(f"SELECT pg_advisory_lock({_PG_MIGRATION_LOCK})")
            connection.commit()
        try:
            context.configure(
                connection=connection,
                target_metadata=None,
                render_as_batch=is_sqlite,
                compare_type=True,
            )
            with context.begin_transaction():
                context.run_migrations()
        finally:
            if connection.dialect.name == "postgresql":
                connection.exec_driver_sql(f"SELECT pg_advisory_unlock({_PG_MIGRATION_LOCK})")
                connection.commit()
    engine.dispose()


if context.is_offline_mode():
    raise SystemExit("the recorder's migrations run online only (db.migrate)")
run_migrations_online()
