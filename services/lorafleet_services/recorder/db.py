"""The recorder's database: engines for PostgreSQL and SQLite, and migrations.

Two URL forms: `postgresql+psycopg://user@host:5432/db` (a fleet's system of
record) and `sqlite+aiosqlite:///path/to/lorafleet.db` (the embedded
default). SQLite runs in WAL mode with a busy timeout, foreign keys on, and
every transaction starts with BEGIN IMMEDIATE, so that writers serialise up
front (no SQLITE_BUSY_SNAPSHOT) and the guarded updates behave the same on
both backends. `migrate(url)` is Alembic's `upgrade head`, skipped without
importing Alembic at `HEAD_REVISION` (bench/recorder_start.py);
`migrate_when_up` waits for a PostgreSQL that is down or starting
(docs/deploy.md; tests/nemesis/test_found.py pins it).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import sqlalchemy
import sqlalchemy.exc
from sqlalchemy import event, pool
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)

from lorafleet import log
from lorafleet.errors import ConnectError
from lorafleet.log import Event

if TYPE_CHECKING:
    from alembic.config import Config

#: Milliseconds a SQLite connection waits for the write lock before failing.
SQLITE_BUSY_TIMEOUT_MS = 30_000

#: The newest migration's revision (tests/recorder/test_migrations.py holds
#: it to Alembic's head): bump it with each new file in migrations/versions.
HEAD_REVISION = "0009"

#: Seconds between tries of a PostgreSQL that does not answer at start.
DATABASE_RETRY_PAUSE_S = 1.0
#: SQLSTATE classes of a server that is there but not answering yet:
#: 08 connection exception, 53 insufficient resources (too many
#: connections), 57 operator intervention (57P03: starting up, 57P01:
#: shutting down). A wrong password (28) or database (3D) is not waited for.
_DOWN_SQLSTATE_CLASSES = ("08", "53", "57")

_MIGRATIONS = Path(__file__).parent / "migrations"

Sessions = async_sessionmaker[AsyncSession]


class DatabaseUrlError(ValueError):
    """A database URL the recorder cannot use."""


class DatabaseUnavailableError(ConnectError):
    """The database did not answer within `Settings.database_wait_s` at start."""


def _check(url: str) -> str:
    backend = make_url(url).get_backend_name()
    if backend not in ("postgresql", "sqlite"):
        raise DatabaseUrlError(
            f"database URL {make_url(url).render_as_string(hide_password=True)!r}: use "
            "postgresql+psycopg://user@host/db or sqlite+aiosqlite:///path/to/lorafleet.db"
        )
    return backend


def _sqlite_parent(url: str) -> None:
    database = make_url(url).database
    if database and database != ":memory:" and not database.startswith("file:"):
        Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)


def sync_url(url: str) -> str:
    """The same database through a synchronous driver (for Alembic)."""
    u = make_url(url)
    if u.get_backend_name() == "sqlite":
        return u.set(drivername="sqlite").render_as_string(hide_password=False)
    if u.get_backend_name() == "postgresql":
        return u.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)
    _check(url)
    return url


def create_engine(url: str, **kwargs: Any) -> AsyncEngine:
    """An async engine for `url` (PostgreSQL through psycopg 3, or aiosqlite)."""
    backend = _check(url)
    if backend == "sqlite":
        _sqlite_parent(url)
        engine = create_async_engine(url, **kwargs)

        @event.listens_for(engine.sync_engine, "connect")
        def _on_connect(dbapi_connection: Any, _record: Any) -> None:
            # Let the "begin" hook below issue BEGIN itself (pysqlite would
            # otherwise defer it to the first write, as a DEFERRED transaction).
            dbapi_connection.isolation_level = None
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.close()

        @event.listens_for(engine.sync_engine, "begin")
        def _on_begin(conn: Any) -> None:
            conn.exec_driver_sql("BEGIN IMMEDIATE")

        return engine
    kwargs.setdefault("pool_pre_ping", True)
    return create_async_engine(url, **kwargs)


def sessions(engine: AsyncEngine) -> Sessions:
    """The session factory every store function takes."""
    return async_sessionmaker(engine, expire_on_commit=False)


def _quiet_alembic() -> None:
    """Alembic's INFO lines (on import, "setup plugin ...", and as it
    migrates) are plain text; the services log JSON lines only. Called
    before each import of Alembic: it is imported only when it is used."""
    alembic_log = logging.getLogger("alembic")
    if alembic_log.level == logging.NOTSET:
        alembic_log.setLevel(logging.WARNING)


def alembic_config(url: str) -> Config:
    _quiet_alembic()
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(_MIGRATIONS))
    # ConfigParser interpolates '%': a password with one must survive.
    cfg.set_main_option("sqlalchemy.url", sync_url(url).replace("%", "%%"))
    return cfg


def revision(url: str) -> str | None:
    """The revision the database at `url` is at; None before its first migration."""
    engine = sqlalchemy.create_engine(sync_url(url), poolclass=pool.NullPool)
    try:
        with engine.connect() as conn:
            rows = conn.exec_driver_sql("SELECT version_num FROM alembic_version").all()
    except (sqlalchemy.exc.ProgrammingError, sqlalchemy.exc.OperationalError):
        return None  # no alembic_version table yet (OperationalError on SQLite)
    finally:
        engine.dispose()
    return rows[0][0] if len(rows) == 1 else None


def migrate(url: str) -> None:
    """Bring the database at `url` to the newest schema (Alembic `upgrade head`).

    Synchronous; call it through `asyncio.to_thread` from async code. The
    SQLite file's directory is created when missing. A database at
    `HEAD_REVISION` is not touched (Alembic is imported only to migrate).
    """
    if _check(url) == "sqlite":
        _sqlite_parent(url)
    if revision(url) == HEAD_REVISION:
        return
    _quiet_alembic()
    from alembic import command

    command.upgrade(alembic_config(url), "head")


def database_down(e: sqlalchemy.exc.OperationalError) -> bool:
    """Whether `e` is a PostgreSQL that does not answer (yet): no connection
    at all (no SQLSTATE) or one of `_DOWN_SQLSTATE_CLASSES`."""
    state = getattr(e.orig, "sqlstate", None)
    return state is None or str(state)[:2] in _DOWN_SQLSTATE_CLASSES


async def migrate_when_up(url: str, wait_s: float, pause_s: float = DATABASE_RETRY_PAUSE_S) -> None:
    """`migrate(url)`, trying a PostgreSQL that does not answer again every
    `pause_s` for `wait_s` seconds (each try logged as `database.waiting`);
    raises DatabaseUnavailableError after. SQLite is tried once: there is no
    server to wait for."""
    if _check(url) == "sqlite":
        await asyncio.to_thread(migrate, url)
        return
    loop = asyncio.get_running_loop()
    started = loop.time()
    for tries in itertools.count(1):
        try:
            await asyncio.to_thread(migrate, url)
            return
        except sqlalchemy.exc.OperationalError as e:
            if not database_down(e):
                raise
            said = str(e.orig).strip().splitlines()[0] if e.orig else str(e)
            waited_s = loop.time() - started
            if waited_s + pause_s > wait_s:
                raise DatabaseUnavailableError(
                    f"the database at {make_url(url).render_as_string(hide_password=True)} did "
                    f"not answer within LORAFLEET_DATABASE_WAIT_S={wait_s:g} s ({tries} tries; "
                    f"the last: {said}): start PostgreSQL, correct LORAFLEET_DATABASE_URL, or "
                    "raise LORAFLEET_DATABASE_WAIT_S"
                ) from None
            log.get().warning(
                Event.DATABASE_WAITING, tries=tries, waited_s=round(waited_s, 1),
                wait_s=wait_s, error=said,
            )  # fmt: skip
            await asyncio.sleep(pause_s)
