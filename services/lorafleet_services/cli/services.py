"""The services, one command each, and `up`/`demo`: all of lorafleet on one machine."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from lorafleet._metrics_http import endpoints_text
from lorafleet.settings import Settings
from lorafleet_schemas.messages import Engine
from lorafleet_services.agent.config import AgentConfig
from lorafleet_services.agent.environment.gguf_conversion import (
    ConversionError,
    local_conversion_source,
)
from lorafleet_services.cli._app import DEMO_ENGINE, EMBEDDED_NATS_PORT, app, err, writable_dir
from lorafleet_services.gateway.config import GatewayConfig
from lorafleet_services.stack import (
    LOCAL_NODE,
    ConversionPreparer,
    EmbeddedStack,
    local_agent_config,
    next_steps,
)

if TYPE_CHECKING:
    from lorafleet._runtime import Program

#: Seconds between two looks of `lorafleet up` at its children.
UP_WATCH_INTERVAL_S = 0.5
#: Where `lorafleet up`'s first process serves /metrics (the others: 9461, ...).
UP_METRICS_ADDR = "127.0.0.1:9460"


def run_service(program: Program) -> None:
    """Run a service as this process (its exit codes are the table's:
    `_runtime` uses lorafleet/exits.py)."""
    from lorafleet import _runtime as runtime

    runtime.main(program)


@app.command("recorder", rich_help_panel="Services")
def recorder_cmd() -> None:
    """Run the recorder (the system of record) until SIGTERM."""
    from lorafleet_services.recorder.service import PROGRAM

    run_service(PROGRAM)


@app.command("scheduler", rich_help_panel="Services")
def scheduler_cmd() -> None:
    """Run the scheduler until SIGTERM."""
    from lorafleet_services.scheduler.service import PROGRAM

    run_service(PROGRAM)


@app.command("artifact-store", rich_help_panel="Services")
def artifact_store_cmd() -> None:
    """Run the artifact-store until SIGTERM."""
    from lorafleet_services.artifact_store.service import PROGRAM

    run_service(PROGRAM)


@app.command("gateway", rich_help_panel="Services")
def gateway_cmd() -> None:
    """Run the HTTP gateway (OpenAI's fine-tuning API, inference routed to the
    engines) until SIGTERM; its settings are LORAFLEET_GATEWAY_* (docs/settings.md)."""
    from lorafleet_services.gateway.service import main

    main()


@app.command("agent", rich_help_panel="Services")
def agent_cmd(
    node: str = typer.Option(..., help="This node's name (letters, digits, - and _)."),
    engines_dir: Path | None = typer.Option(None, help="Where engines are installed."),
    work_dir: Path | None = typer.Option(None, help="The agent's own directory."),
    run_as: str | None = typer.Option(None, help="The engines' unprivileged user."),
    allow_cpu: bool = typer.Option(False, help="Train on the CPU when there is no card."),
    python: str | None = typer.Option(None, help="Trainer interpreter (default: newest vLLM's)."),
    wheel_dir: str | None = typer.Option(None, help="Local wheels for the overlay (offline)."),
) -> None:
    """Run a node's agent until SIGTERM."""
    from lorafleet import _runtime as runtime

    overrides: dict[str, Any] = {
        "node": node,
        "engines_dir": engines_dir,
        "work_dir": work_dir,
        "run_as": run_as,
        "python": python,
        "wheel_dir": wheel_dir,
    }
    if allow_cpu:
        overrides["allow_cpu"] = True
    from lorafleet_services.agent.service import program

    run_service(program(runtime.read_or_exit("agent", lambda: AgentConfig.from_env(**overrides))))


@app.command("up", rich_help_panel="Services")
def up_cmd(
    data_dir: Path | None = typer.Option(
        None,
        help="Default: lorafleet's --data-dir, else LORAFLEET_DATA_DIR (the commands "
        "find it there: `up` prints the line that points them at it).",
    ),
    nats_port: int = typer.Option(EMBEDDED_NATS_PORT, help="The embedded nats-server's port."),
    node: str = typer.Option(LOCAL_NODE, help="The local agent's node name."),
    agent: bool = typer.Option(True, help="Run a local agent."),
    gateway: bool = typer.Option(
        True,
        help="Run the HTTP gateway (OpenAI's API) on LORAFLEET_GATEWAY_ADDR, "
        "default 127.0.0.1:8090.",
    ),
    metrics_addr: str | None = typer.Option(
        None,
        help="Where the first process serves /metrics, the others on the next ports; "
        f'"" for none. Default: LORAFLEET_METRICS_ADDR, else {UP_METRICS_ADDR}.',
    ),
    serve: bool = typer.Option(
        False,
        "--serve",
        help="Also run the CPU vLLM (installed once, in the engines cache), as `demo --serve` "
        "does; `models add-demo` then adds the model it serves.",
    ),
) -> None:
    """Run all of lorafleet on this machine (embedded NATS, SQLite, one agent)."""
    from lorafleet import _runtime as runtime
    from lorafleet import log

    if serve and not agent:
        raise typer.BadParameter(
            "the local agent serves the adapters on the CPU vLLM: drop --no-agent",
            param_hint="--serve",
        )
    base = runtime.read_or_exit("up", Settings.from_env)
    # Absolute: `up` prints it for commands run from other directories.
    directory = writable_dir(data_dir or Path(base.data_dir), "--data-dir").absolute()
    log.configure("up", base.log_level)
    # The services log JSON into a pipe; a person at a terminal reads them
    # rendered, copied by a thread: a terminal that falls behind never stalls them.
    shown = log.ConsoleLines(sys.stderr) if log.log_format(sys.stderr) == "console" else sys.stderr
    echo = log.BackgroundLines(shown)
    stack = EmbeddedStack(data_dir=directory, nats_port=nats_port, echo=echo)
    stack.gateway = runtime.read_or_exit("up", GatewayConfig.from_env) if gateway else None
    stack.metrics_addr = base.metrics_addr or UP_METRICS_ADDR
    if metrics_addr is not None:
        stack.metrics_addr = metrics_addr
    try:
        asyncio.run(_up(stack, node if agent else None, serve))
    finally:
        echo.close()


async def _up(stack: EmbeddedStack, node: str | None, serve: bool) -> None:
    """Run `stack` — with a local agent named `node` unless None, beside the
    CPU vLLM with `serve` — until it is told to stop, saying what to type next."""
    from lorafleet import _runtime as runtime
    from lorafleet_services.demo import DEMO_MODEL, SERVED_MODEL, serving_engine

    async with contextlib.AsyncExitStack() as scope:
        if node is not None:
            stack.agent = await up_agent_config(stack.data_dir, node)
        if serve and stack.agent is not None:
            from lorafleet_services.demo_serve import served_by

            # Stopped after the stack (the exit stack unwinds last): the agent goes first.
            engine = await scope.enter_async_context(serving_engine(stack.data_dir, err))
            stack.agent = served_by(stack.agent, engine)
        settings = await stack.start()
        # Before saying it is up: a signal sent once it says so (a test's
        # SIGHUP did, in the few ms before) must find the handlers there.
        # SIGHUP: its terminal closed.
        stop = runtime.stop_on_signals(signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        err.print(
            f"[green]lorafleet is up[/green]: NATS {settings.nats_url}, "
            f"database {settings.effective_database_url}; Ctrl-C stops it",
            soft_wrap=True,
        )
        gateway_url = stack.gateway_url()
        if gateway_url:
            err.print(
                f"OpenAI API: {gateway_url}/v1 (a key: lorafleet auth api-key create NAME)",
                highlight=False, soft_wrap=True, markup=False,
            )  # fmt: skip
        model = SERVED_MODEL if serve else DEMO_MODEL
        hints = "\n".join(next_steps(stack.data_dir, node, model))
        err.print(hints, highlight=False, soft_wrap=True, markup=False)
        err.print(endpoints_text(stack.metrics_urls()), highlight=False, markup=False)
        await _until_stopped(stack, stop)


async def _until_stopped(stack: EmbeddedStack, stop: asyncio.Event) -> None:
    """Wait for `stop` or a child's exit; then stop the stack."""
    try:
        while not stop.is_set():
            if stack.crashed():
                err.print(f"[red]stopped[/red]: {', '.join(stack.crashed())} exited")
                break
            await asyncio.sleep(UP_WATCH_INTERVAL_S)
    finally:
        await stack.stop()


async def up_agent_config(
    directory: Path, node: str, prepare: ConversionPreparer = local_conversion_source
) -> AgentConfig:
    """The local agent's config; without PyPI reachable it still starts, and says
    where GGUF conversion will fetch llama.cpp's code from instead."""
    try:
        return await local_agent_config(directory, node, prepare=prepare)
    except ConversionError as e:
        config = await local_agent_config(directory, node, prepare=None)
        err.print(
            f"[yellow]warning[/yellow] {e}; GGUF conversion will fetch "
            f"{config.conversion_source}: set LORAFLEET_AGENT_CONVERSION_SOURCE "
            "to a local llama.cpp source tarball to convert offline"
        )
        return config


@app.command("demo", rich_help_panel="Services")
def demo_cmd(
    data_dir: Path | None = typer.Option(None, help="Default: a new temporary directory."),
    out: Path = typer.Option(Path("lorafleet-demo-artifacts"), help="Where artifacts go."),
    engine: Engine = typer.Option(DEMO_ENGINE, help="llamacpp also makes a GGUF."),
    serve: bool = typer.Option(
        False,
        "--serve",
        help="Then serve the adapter on the CPU vLLM (installed once) and print the base "
        "model's and the adapter's answers side by side (implies vllm).",
    ),
) -> None:
    """The main job on the embedded default: train a tiny model's adapter on
    the CPU through the whole system, then download and check its artifacts."""
    from lorafleet_services.demo import run_demo

    if data_dir is not None:
        writable_dir(data_dir, "--data-dir")
    writable_dir(out, "--out")
    code = asyncio.run(
        run_demo(data_dir=data_dir, out_dir=out, engine=engine, console=err, serve=serve)
    )
    raise typer.Exit(code)
