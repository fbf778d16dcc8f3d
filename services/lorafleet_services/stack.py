"""The embedded default: one machine running all of lorafleet.

`lorafleet up` and `lorafleet demo` use `EmbeddedStack`: a nats-server from
the pinned wheel, SQLite, the recorder, scheduler and artifact-store, the
HTTP gateway when asked (`lorafleet up` asks), and one local agent that may
train on the CPU — each service a child process, as in
production. The local agent's config is `local_agent_config` here, for both
commands. The tests use `ServiceProcess` the same way (tests/procs.py adds
their waits).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from lorafleet import _runtime as runtime
from lorafleet._metrics_http import child_addr
from lorafleet._process import die_with_parent
from lorafleet.nats import _bus as bus
from lorafleet.nats.server import NatsServer
from lorafleet.settings import Settings, default_data_dir
from lorafleet_services.agent.config import AgentConfig
from lorafleet_services.agent.environment.gguf_conversion import local_conversion_source
from lorafleet_services.gateway.config import GatewayConfig

#: Seconds a child service has to log `service.started`.
SERVICE_START_TIMEOUT_S = 60.0
#: Seconds a child has between SIGTERM and SIGKILL in `ServiceProcess.stop`.
SERVICE_STOP_GRACE_S = 10.0
#: Seconds the log reader gets to drain after a child has exited.
READER_DRAIN_TIMEOUT_S = 5.0
#: Seconds the log reader gets to drain after a failed start.
FAILED_START_DRAIN_TIMEOUT_S = 2.0
#: Log lines of a child quoted when it fails to start.
FAILED_START_TAIL_LINES = 30
#: Log lines of each child an EmbeddedStack keeps (a failed start's tail, the
#: start's events): `lorafleet up` runs for days, its children log per step.
KEPT_LINES = 1000

#: Node name of the embedded default's local agent.
LOCAL_NODE = "local"
#: The demo job's memory budget: the trainer keeps to it on the CPU too, and
#: the tiny Llama's estimate is about 500 MiB (the process counted).
DEMO_MEMORY_MIB = 1024
#: Where, under the data directory, the local llama.cpp conversion code is kept.
LOCAL_CONVERSION_DIR = "llama.cpp-source"

_AGENT_ENV_PREFIX = "LORAFLEET_AGENT_"
#: The demo's question/answer pairs, written into the data directory by `lorafleet up`.
DEMO_DATA_FILE = "demo-pairs.jsonl"
#: The URL of the CPU vLLM that `up --serve` (or `demo --serve`) runs, in the
#: data directory while it runs: `models add-demo` then adds the model it serves.
VLLM_URL_FILE = "vllm-url"

#: Prepares llama.cpp's conversion code in a directory: (conversion_source, llamacpp_tag).
ConversionPreparer = Callable[[Path], Awaitable[tuple[str, str]]]


async def local_agent_config(
    data_dir: Path,
    node: str = LOCAL_NODE,
    env: Mapping[str, str] | None = None,
    *,
    prepare: ConversionPreparer | None = local_conversion_source,
) -> AgentConfig:
    """The local agent of `lorafleet up` and `lorafleet demo`.

    It trains in this very Python (there is no vLLM here), on the CPU when
    there is no card, as the user running the command, with engines and work
    directory under `data_dir`. Unless the user names a llama.cpp source or
    tag, GGUF conversion uses llama.cpp's code from PyPI's llama-cpp-python
    (`prepare`, once per data directory; no GitHub needed); a tag alone is
    fetched from the default source, since the local one holds one release.
    prepare=None keeps the default source. Every `LORAFLEET_AGENT_*` in `env`
    (default os.environ) wins over these defaults; `node` wins over the
    environment's, as a command-line option does.

    Raises ConversionError when `prepare` cannot fetch the code.
    """
    env = os.environ if env is None else env
    defaults: dict[str, object] = {
        "engines_dir": data_dir / "engines",
        "work_dir": data_dir / "agent",
        "allow_cpu": True,
        "python": sys.executable,
        "run_as": "",
    }
    if prepare is not None and not _agent_env_sets(env, "conversion_source", "llamacpp_tag"):
        source, tag = await prepare(data_dir / LOCAL_CONVERSION_DIR)
        defaults.update(conversion_source=source, llamacpp_tag=tag)
    unset = {k: v for k, v in defaults.items() if not _agent_env_sets(env, k)}
    return AgentConfig.from_env(env, **unset, node=node)


def next_steps(data_dir: Path, node: str | None, model: str) -> list[str]:
    """What `lorafleet up` tells its user to type next, and where things are;
    `model`: the catalog name `models add-demo` gives the demo's model."""
    lines = [
        f"data (NATS store, SQLite database, agent work, API keys): {data_dir}",
        "next, in another terminal:",
    ]
    if data_dir.resolve() != Path(default_data_dir()).resolve():
        # Another terminal would look in the default directory: the NATS URL,
        # the demo's files and the gateway's keys are here instead.
        lines.append(
            f"  export LORAFLEET_DATA_DIR={shlex.quote(str(data_dir))}"
            "   # or: lorafleet --data-dir DIR COMMAND"
        )
    lines += [
        f"  lorafleet models add-demo                      # {model}: a tiny Llama, built here",
        f"  lorafleet submit --model {model} --gpu-memory-mib {DEMO_MEMORY_MIB}"
        + f" --data {data_dir / DEMO_DATA_FILE}"
        + (f" --node {node}" if node else "")
        + " --watch",
        "  lorafleet watch JOB                            # follow a job (Ctrl-C leaves it be)",
        "  lorafleet top                                  # the fleet: nodes, running jobs, queue",
        "  lorafleet jobs show JOB --png loss.png         # a job's loss curve",
    ]
    if node is None:
        lines.insert(1, "no local agent (--no-agent): start `lorafleet agent --node NAME`")
    return lines


def _agent_env_sets(env: Mapping[str, str], *fields: str) -> bool:
    return any(f"{_AGENT_ENV_PREFIX}{name.upper()}" in env for name in fields)


class Echo(Protocol):
    """Where a child's log lines are copied: a text stream (sys.stderr, log.ConsoleLines)."""

    def write(self, text: str, /) -> int: ...
    def flush(self) -> None: ...


class ServiceStartError(RuntimeError):
    """A child service did not start: it exited, stayed silent, or was never started."""


class ServiceProcess:
    """`python -m <module> [args]` with `settings` in its environment.

    The child logs JSON lines on stderr; `lines` keeps them decoded, `raw` as
    text, and `echo` (if given) receives each raw line. `start()` returns
    once the child has logged `service.started`.
    """

    def __init__(
        self,
        module: str,
        settings: Settings,
        args: list[str] | None = None,
        env: Mapping[str, str] | None = None,
        echo: Echo | None = None,
        keep_lines: int | None = None,
    ) -> None:
        self.module = module
        self.settings = settings
        self.args = args or []
        self.env = dict(env or {})
        self.echo = echo
        self.proc: asyncio.subprocess.Process | None = None
        #: Its log lines, decoded and as written: all (tests read them), or
        #: with `keep_lines` the newest that many at least (a long-running
        #: `up`: trimmed to that once twice as many).
        self.lines: list[dict[str, Any]] = []
        self.raw: list[str] = []
        self.keep_lines = keep_lines
        self._reader: asyncio.Task[None] | None = None
        self._started = asyncio.Event()

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise ServiceStartError(f"{self.module} has not been started")
        return self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def start(self, timeout_s: float = SERVICE_START_TIMEOUT_S) -> ServiceProcess:
        # JSON whatever the user's LORAFLEET_LOG_FORMAT: `start()` reads the
        # child's lines; `echo` may render them for a person (log.ConsoleLines).
        env = {
            **os.environ,
            **self.settings.to_env(),
            **self.env,
            "PYTHONUNBUFFERED": "1",
            "LORAFLEET_LOG_FORMAT": "json",
        }
        self._started = asyncio.Event()
        # Its own session (a Ctrl-C meant for `up` reaches `up` alone, which
        # stops the children in order), and a parent-death SIGTERM (`up`
        # killed outright leaves no service holding its ports and store).
        self.proc = await asyncio.create_subprocess_exec(
            *die_with_parent(self.command()),
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
            start_new_session=True, limit=1 << 20,
        )  # fmt: skip
        if self.proc.stderr is None:  # pragma: no cover - stderr=PIPE always gives one
            raise ServiceStartError(f"{self.module} has no stderr pipe")
        self._reader = asyncio.create_task(self._read(self.proc.stderr))
        waiter = asyncio.create_task(self._started.wait())
        exited = asyncio.create_task(self.proc.wait())
        try:
            await asyncio.wait(
                {waiter, exited}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            waiter.cancel()
            exited.cancel()
        if not self._started.is_set():
            await self.stop()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._reader, FAILED_START_DRAIN_TIMEOUT_S)
            raise ServiceStartError(f"{self.module} did not start:\n" + self.tail())
        return self

    def command(self) -> list[str]:
        """The child's argv: this Python running the module with `args`."""
        return [sys.executable, "-m", self.module, *self.args]

    def is_ready(self, line: dict[str, Any] | None, text: str) -> bool:
        """The child's log line (decoded, else None; and as written) says it is
        ready: a lorafleet service's `service.started`."""
        return line is not None and line.get("event") == "service.started"

    def tail(self, lines: int = FAILED_START_TAIL_LINES) -> str:
        """The child's last `lines` log lines, as it wrote them."""
        return "".join(self.raw[-lines:])

    async def _read(self, stderr: asyncio.StreamReader) -> None:
        while line := await stderr.readline():
            text = line.decode(errors="replace")
            self.raw.append(text)
            if self.echo is not None:
                self.echo.write(text)
                self.echo.flush()
            obj = None
            with contextlib.suppress(ValueError):
                obj = json.loads(text)
            line_obj = obj if isinstance(obj, dict) else None
            if line_obj is not None:
                self.lines.append(line_obj)
            if self.keep_lines is not None and len(self.raw) > 2 * self.keep_lines:
                del self.raw[: -self.keep_lines]
                del self.lines[: -self.keep_lines]
            if self.is_ready(line_obj, text):
                self._started.set()

    def events(self, name: str) -> list[dict[str, Any]]:
        return [ln for ln in self.lines if ln.get("event") == name]

    def kill(self) -> None:
        """SIGKILL the whole process group at once."""
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    async def stop(
        self, timeout_s: float = SERVICE_STOP_GRACE_S, signum: int = signal.SIGTERM
    ) -> int | None:
        """`signum`, wait `timeout_s` seconds, then SIGKILL; return the exit code."""
        proc = self.proc
        if proc is None:
            return None
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signum)
            try:
                await asyncio.wait_for(proc.wait(), timeout_s)
            except TimeoutError:
                self.kill()
                await proc.wait()
        # What it started and left behind (a SIGKILLed gateway's check workers)
        # would hold its stderr open: its session, its own since start, goes too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        if self._reader is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._reader, READER_DRAIN_TIMEOUT_S)
        return proc.returncode

    async def __aenter__(self) -> ServiceProcess:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


#: The services of a control plane, in start order.
CONTROL_PLANE = (
    "lorafleet_services.recorder",
    "lorafleet_services.scheduler",
    "lorafleet_services.artifact_store",
)

#: The HTTP gateway's module (started after the control plane, when asked).
GATEWAY = "lorafleet_services.gateway"


@dataclass
class EmbeddedStack:
    """Everything on one machine. `data_dir` keeps the NATS store, the SQLite
    database and the agent's work directory across runs.

    nats_port: 0 picks a free port; `lorafleet up` uses 4250 by default so
        that a NATS on 4222 is left alone.
    agent: the local agent's config; None runs no agent.
    gateway: the HTTP gateway's config; None (default) runs no gateway.
    metrics_addr: where the children serve /metrics: "" none; "host:port"
        the first child's, each next one the next port (port 0: each a free
        one). `metrics_urls()` says where they are.
    """

    data_dir: Path
    nats_port: int = 0
    agent: AgentConfig | None = None
    gateway: GatewayConfig | None = None
    echo: Echo | None = None
    settings: Settings | None = None
    nats: NatsServer | None = None
    children: list[ServiceProcess] = field(default_factory=list)
    metrics_addr: str = ""

    async def start(self) -> Settings:
        # alembic logs INFO lines on import ("setup plugin ..."): nothing for a user.
        logging.getLogger("alembic").setLevel(logging.WARNING)
        from lorafleet_services.recorder.db import migrate

        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.nats = NatsServer(self.data_dir / "nats", port=self.nats_port)
        await self.nats.start()
        base = Settings.from_env()
        self.settings = base.with_(nats_url=self.nats.url, data_dir=str(self.data_dir))
        (self.data_dir / "nats-url").write_text(self.nats.url + "\n")
        # Migrating first keeps the recorder's start fast and its errors plain.
        await asyncio.to_thread(migrate, self.settings.effective_database_url)
        nc = await bus.connect(self.settings, "lorafleet-up")
        try:
            await runtime.ensure_layout_retrying(nc.jetstream(), self.settings)
        finally:
            await bus.drain_quietly(nc)
        try:
            for module in CONTROL_PLANE:
                await self._spawn(module, self.settings, {})
            if self.gateway is not None:
                await self._spawn(GATEWAY, self.settings, self.gateway.to_env())
            if self.agent is not None:
                await self._spawn("lorafleet_services.agent", self.settings, self.agent.to_env())
        except BaseException:
            await self.stop()
            raise
        return self.settings

    async def _spawn(self, module: str, settings: Settings, env: dict[str, str]) -> ServiceProcess:
        addr = child_addr(self.metrics_addr, len(self.children))
        env = {**env, "LORAFLEET_METRICS_ADDR": addr}
        proc = ServiceProcess(module, settings, env=env, echo=self.echo, keep_lines=KEPT_LINES)
        await proc.start()
        self.children.append(proc)
        return proc

    async def stop(self) -> None:
        for child in reversed(self.children):
            await child.stop()
        self.children.clear()
        if self.nats is not None:
            await self.nats.stop()
        with contextlib.suppress(FileNotFoundError):
            (self.data_dir / "nats-url").unlink()

    def metrics_urls(self) -> dict[str, str]:
        """{service: its /metrics URL} of the children that serve one."""
        urls: dict[str, str] = {}
        for child in self.children:
            started = child.events("service.started")
            if started and started[-1].get("metrics"):
                urls[child.module.rsplit(".", 1)[-1].replace("_", "-")] = started[-1]["metrics"]
        return urls

    def gateway_url(self) -> str | None:
        """The running gateway's URL (its `gateway.listening` line), if one runs."""
        for child in self.children:
            if child.module == GATEWAY and child.events("gateway.listening"):
                return str(child.events("gateway.listening")[-1]["url"])
        return None

    def crashed(self) -> list[str]:
        """Modules of children that have exited on their own."""
        return [c.module for c in self.children if not c.running]
