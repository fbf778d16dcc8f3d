"""The CLI's tests: the real `lorafleet` command against a running `lorafleet up`
(one per module: embedded NATS, SQLite, the services, a local agent with the
stand-in trainer), typed into a real terminal (tmux) or run with pipes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.cli.terminal import Terminal

ROOT = Path(__file__).resolve().parents[2]
#: Seconds per stand-in step: 300 steps take ~10 s, long enough to look at twice.
STEP_S = "0.03"
#: Seconds `lorafleet up` may take to say it is up.
UP_TIMEOUT_S = 90.0
#: Seconds one `lorafleet` command may take in these tests.
COMMAND_TIMEOUT_S = 120.0
#: Lines of `lorafleet up`'s own output a failed test prints (`log_tail`).
LOG_TAIL_LINES = 80
DATA = "".join(json.dumps({"q": f"what is {i}+{i}?", "a": str(2 * i)}) + "\n" for i in range(20))


def cli_argv(*args: str) -> list[str]:
    """`lorafleet ARGS` as a command line, in this Python."""
    return [sys.executable, "-m", "lorafleet_services.cli", *args]


@dataclass
class Up:
    """A running `lorafleet up` in window 0 of `terminal`, and what the
    commands need to reach it."""

    terminal: Terminal
    env: dict[str, str]
    data_dir: Path
    pairs: Path

    def argv(self, *args: str) -> list[str]:
        return cli_argv(*args)

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last `lines` lines `lorafleet up` printed (its services' logs),
        without the training's progress lines."""
        shown = self.terminal.history(f"{self.terminal.session}:0", joined=True).splitlines()
        kept = [line.rstrip() for line in shown if "job.progress" not in line and line.strip()]
        return "\n".join(kept[-lines:])

    async def lorafleet(
        self, *args: str, env: dict[str, str] | None = None, timeout_s: float = COMMAND_TIMEOUT_S
    ) -> tuple[int, str, str]:
        """Run `lorafleet ARGS` with pipes (not a terminal); (rc, stdout, stderr).
        A command still running after `timeout_s`, or when the caller is
        cancelled, is killed and reaped, so that its pipes never outlive the
        test (they would fail a later test as unclosed transports)."""
        proc = await asyncio.create_subprocess_exec(
            *self.argv(*args), cwd=ROOT, env={**self.env, **(env or {})},
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
        except TimeoutError:
            proc.kill()
            out, err = await proc.communicate()
            raise AssertionError(
                f"lorafleet {' '.join(args)} did not end in {timeout_s:g} s; "
                f"stdout: {out.decode()[-2000:]}; stderr: {err.decode()[-2000:]}"
            ) from None
        finally:
            if proc.returncode is None:
                proc.kill()
                await asyncio.shield(proc.wait())
        assert proc.returncode is not None
        return proc.returncode, out.decode(), err.decode()

    async def submit(self, steps: int, *more: str) -> str:
        """Queue a stand-in job of `steps` steps; its id (from the line saying it is queued)."""
        rc, _, err = await self.submit_raw("--param", f"max_steps={steps}", *more)
        assert rc == 0, err
        return queued_id(err)

    async def submit_raw(self, *more: str) -> tuple[int, str, str]:
        """`lorafleet submit` of model tiny with the pairs and `more`: (rc, stdout, stderr)."""
        return await self.lorafleet(*self.submit_args(*more))

    def submit_args(self, *more: str) -> tuple[str, ...]:
        """The arguments of `lorafleet submit` of model tiny with the pairs and `more`."""
        return (
            "submit", "--model", "tiny", "--gpu-memory-mib", "1", "--data", str(self.pairs), *more
        )  # fmt: skip


def queued_id(err: str) -> str:
    """The job id `lorafleet submit` says it queued, on stderr."""
    found = re.search(r"^queued job (\S+) \(", err, re.M)
    assert found, err
    return found[1]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test that used `up` prints what its services logged: a job
    failed by the control plane says why only there (a node judged lost)."""
    report = yield
    running = getattr(item, "funcargs", {}).get("up")
    if report.when == "call" and report.failed and isinstance(running, Up):
        with contextlib.suppress(Exception):  # a closed terminal: nothing to add
            report.sections.append(("lorafleet up's log, its end", running.log_tail()))
    return report


def up_env(tmp: Path) -> dict[str, str]:
    """The environment `lorafleet up` and the commands run in: data under
    `tmp`, the stand-in trainer, nothing fetched, no fixed port."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(str(ROOT / d) for d in ("schemas", "libs", "services")),
        "LORAFLEET_DATA_DIR": str(tmp / "data"),
        "LORAFLEET_AGENT_TRAINER": "standin",
        "LORAFLEET_STANDIN_STEP_S": STEP_S,
        # A source is named, so `up` fetches nothing (vllm models convert nothing).
        "LORAFLEET_AGENT_CONVERSION_SOURCE": str(tmp / "{tag}.tar.gz"),
        "LORAFLEET_AGENT_LLAMACPP_TAG": "b1",
        "LORAFLEET_CONNECT_TIMEOUT_S": "2",
        # Each child picks a free port: `up`'s default 9460 and on may be taken
        # (an operator's own `lorafleet up` on this machine failed every test).
        "LORAFLEET_METRICS_ADDR": "127.0.0.1:0",
        "LORAFLEET_GATEWAY_ADDR": "127.0.0.1:0",
        "COLUMNS": "120",
    }
    for name in ("LORAFLEET_NATS_URL", "LORAFLEET_LOG_FORMAT", "NO_COLOR"):
        env.pop(name, None)
    return env


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    tmp = tmp_path_factory.mktemp("up")
    data_dir = tmp / "data"
    env = up_env(tmp)
    terminal = Terminal(env, str(ROOT))
    pairs = tmp / "pairs.jsonl"
    pairs.write_text(DATA)
    (tmp / "tiny").mkdir()
    running = Up(terminal, env, data_dir, pairs)
    try:
        window = f"{terminal.session}:0"
        # Port 0: the nats-server takes a free one, and `up` writes its URL into the
        # data directory, where the commands read it.
        terminal.type(window, *running.argv("up", "--nats-port", "0"))
        asyncio.run(terminal.wait_for(window, "lorafleet is up", timeout_s=UP_TIMEOUT_S))
        rc, _, err = asyncio.run(
            running.lorafleet(
                "models", "add", "tiny", "--engine", "vllm", "--local-dir", str(tmp / "tiny")
            )
        )
        assert rc == 0, err
        yield running
    finally:
        terminal.keys(f"{terminal.session}:0", "C-c")
        asyncio.run(_stopped(data_dir))
        terminal.close()


async def _stopped(data_dir: Path) -> None:
    # `up` removes its nats-url file once everything has stopped.
    from tests.eventually import eventually

    await eventually(lambda: not (data_dir / "nats-url").exists(), "lorafleet up stopped")
