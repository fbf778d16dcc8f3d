"""Throwaway PostgreSQL databases for tests and benchmarks (127.0.0.1:5432, trust
auth), and a PostgreSQL of a test's own to stop and start (`PrivatePostgres`).

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
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import psycopg

from tests import disks
from tests.ports import free_port

#: Where CREATE/DROP DATABASE run; LORAFLEET_TEST_PG_ADMIN overrides it.
PG_ADMIN_DSN = os.environ.get(
    "LORAFLEET_TEST_PG_ADMIN", "host=127.0.0.1 port=5432 user=postgres dbname=postgres"
)
#: Seconds one pg_ctl command may take.
PG_CTL_TIMEOUT_S = 60.0
#: The user a private PostgreSQL runs as (initdb refuses root).
PG_USER = "postgres"
#: MiB of WAL a private cluster keeps (max_wal_size; half of it min_wal_size).
WAL_MIB = 64
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


class PrivatePostgres:
    """A PostgreSQL cluster of the run's own in a directory `postgres` owns."""

    def __init__(self, disk_mib: int | None = None) -> None:
        """disk_mib: its data directory on a tmpfs of that size (root), which
        `fill_disk` fills; None: on the temp directory's filesystem."""
        self.dir = Path(tempfile.mkdtemp(prefix="lorafleet-nemesis-pg-"))
        self.port = free_port()
        self.started = False
        self.disk_mib = disk_mib
        self._disk: contextlib.ExitStack | None = None

    @staticmethod
    def unavailable() -> str | None:
        """Why no private PostgreSQL can run here (None: it can)."""
        if shutil.which("pg_ctl") is None or shutil.which("initdb") is None:
            return "no pg_ctl/initdb here"
        if os.geteuid() != 0 or shutil.which("runuser") is None:
            return "not root (initdb must run as the postgres user, started by runuser)"
        try:
            subprocess.run(["id", PG_USER], capture_output=True, check=True)
        except subprocess.CalledProcessError:
            return f"no {PG_USER} user"
        return None

    def _as_postgres(self, *argv: str) -> None:
        subprocess.run(
            ["runuser", "-u", PG_USER, "--", *argv],
            check=True, capture_output=True, timeout=PG_CTL_TIMEOUT_S,
        )  # fmt: skip

    @property
    def data(self) -> Path:
        return self.dir / "data"

    def start(self) -> str:
        """initdb, start; the SQLAlchemy URL of a new database in it."""
        shutil.chown(self.dir, PG_USER)
        if self.disk_mib is not None:
            self._disk = contextlib.ExitStack()
            self._disk.enter_context(disks.small_filesystem(self.data, self.disk_mib))
            shutil.chown(self.data, PG_USER)
            self.data.chmod(0o700)
        self._as_postgres("initdb", "-D", str(self.dir / "data"), "-A", "trust", "-U", "postgres")
        self._pg_ctl("start")
        self.started = True
        import psycopg

        with psycopg.connect(self._dsn("postgres"), autocommit=True) as conn:
            conn.execute("CREATE DATABASE lorafleet")
        return self.url

    @property
    def url(self) -> str:
        """The SQLAlchemy URL of its database `lorafleet`."""
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/lorafleet"

    def _dsn(self, db: str) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname={db}"

    def _pg_ctl(self, action: str, *extra: str) -> None:
        # WAL kept small: on a small disk of its own only `fill_disk` fills it.
        opts = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.dir} "
            f"-c max_wal_size={WAL_MIB}MB -c min_wal_size={WAL_MIB // 2}MB"
        )
        self._as_postgres(
            "pg_ctl", "-D", str(self.dir / "data"), "-o", opts, "-w", "-l",
            str(self.dir / "log"), action, *extra,
        )  # fmt: skip

    def stop_now(self) -> None:
        """Stop at once (an immediate shutdown: what a crash leaves)."""
        self._pg_ctl("stop", "-m", "immediate")

    def start_again(self) -> None:
        self._pg_ctl("start")

    def running(self) -> bool:
        try:
            self._pg_ctl("status")
        except subprocess.CalledProcessError:
            return False
        return True

    def fill_disk(self) -> None:
        """Its data directory's disk full: writes fail (ERROR 53100), and one
        that needs a new WAL segment stops the server (PANIC)."""
        disks.fill(self.data)

    def disk_back(self) -> None:
        """The space back, and the server started if the full disk stopped it."""
        disks.unfill(self.data)
        if not self.running():
            self.start_again()

    def remove(self) -> None:
        if self.started:
            with contextlib.suppress(subprocess.SubprocessError):
                self._pg_ctl("stop", "-m", "immediate")
        if self._disk is not None:
            self._disk.close()
        shutil.rmtree(self.dir, ignore_errors=True)
