"""What every command group shares: the Typer apps, the consoles, the
global --data-dir, the settings a command connects with, and running a
client call as a command."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import msgspec
import nats.errors
import typer
from rich.console import Console, RenderableType
from rich.markup import escape

from lorafleet.client import Client
from lorafleet.errors import ApiError, ConnectError
from lorafleet.exits import Exit, help_epilog
from lorafleet.nats._bus import redact_url
from lorafleet.settings import Settings
from lorafleet_schemas.messages import Engine, Replicas, ServingPolicy

T = TypeVar("T")

app = typer.Typer(
    name="lorafleet",
    help="Train LoRA adapters on the GPU nodes that serve your LLMs.",
    epilog=help_epilog(),
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
models_app = typer.Typer(help="The model catalog.", no_args_is_help=True)
jobs_app = typer.Typer(help="Training jobs.", no_args_is_help=True)
app.add_typer(models_app, name="models", rich_help_panel="Catalog")
app.add_typer(jobs_app, name="jobs", rich_help_panel="Jobs")

console = Console()
err = Console(stderr=True)

#: The setting the global --data-dir sets, for this process and the ones it starts.
DATA_DIR_ENV = "LORAFLEET_DATA_DIR"


@app.callback()
def global_options(
    data_dir: Path | None = typer.Option(
        None,
        "--data-dir",
        envvar=DATA_DIR_ENV,
        show_envvar=False,
        metavar="DIR",
        help="Where `up` keeps its NATS URL, database and API keys, where every command "
        "looks for them (default: LORAFLEET_DATA_DIR, else ~/.local/share/lorafleet).",
    ),
) -> None:
    """Options every command takes, given before the command's name."""
    # Into the environment: every setting is read from it (Settings.from_env,
    # GatewayConfig.from_env), in this process and in the services `up` starts.
    if data_dir is not None:
        os.environ[DATA_DIR_ENV] = str(data_dir)


#: The engine of the demo's tiny model, for `demo` and `models add-demo`
#: alike: llama.cpp, so that the job also makes a GGUF.
DEMO_ENGINE = Engine.LLAMACPP

#: `lorafleet up` listens here unless told otherwise (4222 is often taken).
EMBEDDED_NATS_PORT = 4250


def settings_from_env() -> Settings:
    """Settings from the environment; the NATS URL of a running `lorafleet up`
    when LORAFLEET_NATS_URL is not set."""
    base = Settings.from_env()
    if "LORAFLEET_NATS_URL" not in os.environ:
        url_file = Path(base.data_dir) / "nats-url"
        if url_file.is_file():
            return base.with_(nats_url=url_file.read_text().strip())
        return base.with_(nats_url=f"nats://127.0.0.1:{EMBEDDED_NATS_PORT}")
    return base


#: Seconds between two cancels of a command after Ctrl-C. One cancel can be
#: lost: Python 3.11's asyncio.wait_for drops a cancel that meets its inner
#: future's result, and the command goes on (a suite run's `watch` did not
#: stop within 60 s of its SIGINT, twice).
RECANCEL_S = 0.2


def run_interruptibly(main: Callable[[], Awaitable[T]]) -> T:
    """asyncio.run(main()), where Ctrl-C cancels it again every RECANCEL_S
    until it has ended, then raises KeyboardInterrupt."""

    async def guarded() -> T:
        task = asyncio.current_task()
        if task is None:  # asyncio.run runs its coroutine as a task: never
            raise RuntimeError("run_interruptibly: not in a task")
        loop = asyncio.get_running_loop()
        cancelling: list[asyncio.Task[None]] = []

        async def keep_cancelling() -> None:
            while not task.done():
                task.cancel()
                await asyncio.sleep(RECANCEL_S)

        def on_sigint() -> None:
            if not cancelling:
                cancelling.append(loop.create_task(keep_cancelling()))

        loop.add_signal_handler(signal.SIGINT, on_sigint)
        try:
            return await main()
        except asyncio.CancelledError:
            if cancelling:
                raise KeyboardInterrupt from None
            raise
        finally:
            loop.remove_signal_handler(signal.SIGINT)

    return asyncio.run(guarded())


def run_client(fn: Callable[[Client], Awaitable[T]], interrupted: str = "") -> T:
    """Connect, run `fn`, close; a lorafleet error becomes a one-line message
    and its exit code; Ctrl-C exits 130, saying `interrupted` if given."""

    async def main() -> T:
        async with await Client.connect(settings_from_env()) as client:
            return await fn(client)

    try:
        return run_interruptibly(main)
    except ApiError as e:
        fail(str(e), Exit.REFUSED)
    except ConnectError as e:
        fail(str(e), Exit.UNREACHABLE)
    except (nats.errors.NoRespondersError, nats.errors.TimeoutError, TimeoutError):
        url = redact_url(settings_from_env().nats_url)
        fail(
            f"no lorafleet service answered on {url}: start them (`lorafleet up`, or "
            "`lorafleet recorder`, `scheduler`, `artifact-store`) or set LORAFLEET_NATS_URL",
            Exit.UNREACHABLE,
        )
    except KeyboardInterrupt:
        if interrupted:
            err.print(interrupted, highlight=False, soft_wrap=True)
        raise typer.Exit(Exit.INTERRUPTED) from None


def fail(message: str, code: Exit) -> NoReturn:
    """One line on stderr saying what to change, then exit `code` (no traceback)."""
    err.print(f"[red]error[/red] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def print_json(value: Any) -> None:
    sys.stdout.write(msgspec.json.format(msgspec.json.encode(value)).decode() + "\n")


#: The JOB argument of every command about one job.
JOB_ARGUMENT = typer.Argument(
    ..., metavar="JOB", help="The job's id (`lorafleet jobs list` lists them)."
)

#: `--json` of every command that shows data.
JSON_OPTION = typer.Option(
    False,
    "--json",
    help="Print JSON (the API's records) on stdout instead of the view for a person.",
)


#: `--serving` of `submit` and `models add`: a serving policy.
SERVING_OPTION = typer.Option(
    None,
    "--serving",
    metavar="all|N",
    help="Serve the adapter across the fleet once done: `all` (every live node with an engine "
    "of the base) or N replicas (default: the model's, else only where it trained).",
)


def serving_policy(value: str | None) -> ServingPolicy | None:
    """`--serving`'s value as a policy; a usage error (exit 2) naming the forms otherwise."""
    if value is None:
        return None
    if value == "all":
        return "all"
    if value.isdigit() and int(value) >= 1:
        return Replicas(replicas=int(value))
    raise typer.BadParameter(f"{value!r}: give `all` or a number of replicas (1 or more)")


def show(value: T, as_json: bool, view: Callable[[T], RenderableType | str]) -> None:
    """What every command that shows data does with it: JSON on stdout with
    --json, else `view(value)` for a person."""
    if as_json:
        print_json(value)
    else:
        console.print(view(value), highlight=False, soft_wrap=True)


def read_input(path: Path, option: str) -> bytes:
    """The bytes of the file given as `option`; one line and Exit.BAD_FILE
    when it cannot be read (missing, a directory, no permission)."""
    try:
        return path.read_bytes()
    except OSError as e:
        fail(f"{option} {path}: {_os_reason(e)}: give a readable file", Exit.BAD_FILE)


def unwritable(path: Path, option: str, e: OSError) -> NoReturn:
    """One line and Exit.BAD_FILE for a file or directory `option` names that cannot be written."""
    fail(f"{option} {path}: {_os_reason(e)}: give a path this user can write", Exit.BAD_FILE)


def writable_dir(path: Path, option: str) -> Path:
    """`path`, made if missing; one line and Exit.BAD_FILE when it cannot be."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        unwritable(path, option, e)
    return path


def _os_reason(e: OSError) -> str:
    return (e.strerror or type(e).__name__).lower()
