"""Throwaway PostgreSQL databases for tests and benchmarks (127.0.0.1:5432, trust auth).

Alembic runs once per test session, into a template database; each test's
database is a copy of it (`CREATE DATABASE ... TEMPLATE`, a file copy on
the server: a few tens of milliseconds where migrating took far more).
A template's name carries the pid of the session that made it, so two
test runs at once on this machine never share one, and a template left by
a killed run is dropped by the next.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from collections.abc import Iterator
from contextlib import contextmanager

import psutil
import psycopg

#: Where CREATE/DROP DATABASE run; LORAFLEET_TEST_PG_ADMIN overrides it.
PG_ADMIN_DSN = os.environ.get(
    "LORAFLEET_TEST_PG_ADMIN", "host=127.0.0.1 port=5432 user=postgres dbname=postgres"
)
#: Names of the migrated templates: `<prefix>_<pid>_<hex>`.
TEMPLATE_PREFIX = "lorafleet_tmpl"

_TEMPLATE_NAME = re.compile(rf"^{TEMPLATE_PREFIX}_(\d+)_[0-9a-f]+$")


def database_url(name: str) -> str:
    """The SQLAlchemy URL of database `name` on the test server."""
    return f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"


@contextmanager
def throwaway_database(
    prefix: str = "lorafleet_test",
    admin_dsn: str = PG_ADMIN_DSN,
    migrate: bool = True,
    template: str | None = None,
) -> Iterator[str]:
    """A new database; its SQLAlchemy URL while the block runs; dropped
    (connections forced off) after. With `template` it is a copy of that
    database (no connection may be open to it meanwhile) and `migrate` is
    ignored; without, it is migrated with Alembic unless `migrate` is False."""
    name = f"{prefix}_{secrets.token_hex(6)}"
    copy_of = f' TEMPLATE "{template}"' if template is not None else ""
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"{copy_of}')
    try:
        url = database_url(name)
        if migrate and template is None:
            from lorafleet_services.recorder.db import migrate as run_migrations

            run_migrations(url)
        yield url
    finally:
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextmanager
def migrated_template(admin_dsn: str = PG_ADMIN_DSN) -> Iterator[str]:
    """A database migrated with Alembic, for `throwaway_database(template=...)`;
    its name while the block runs; dropped after. Templates of sessions that
    are no longer running are dropped first."""
    drop_orphaned_templates(admin_dsn)
    with throwaway_database(f"{TEMPLATE_PREFIX}_{os.getpid()}", admin_dsn) as url:
        yield url.rsplit("/", 1)[1]


def drop_orphaned_templates(admin_dsn: str = PG_ADMIN_DSN) -> list[str]:
    """Drop the templates whose session's pid is gone (a killed test run); their names."""
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        names = [row[0] for row in conn.execute("SELECT datname FROM pg_database")]
        orphans = [
            n
            for n in names
            if (m := _TEMPLATE_NAME.match(n)) is not None and not psutil.pid_exists(int(m[1]))
        ]
        for name in orphans:
            # Another session may be dropping the same orphan right now.
            with contextlib.suppress(psycopg.Error):
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    return orphans
