"""What every command group shares: the Typer apps, the consoles, the
settings a command connects with, and running a client call as a command."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import msgspec
import nats.errors
import typer
from rich.console import Console

from lorafleet.client import Client
from lorafleet.errors import ApiError, ConnectError
from lorafleet.nats._bus import redact_url
from lorafleet.settings import Settings

T = TypeVar("T")

#: Exit codes (docs/cli.md): 0 done; 1 the job failed, or a request was
#: refused (unknown job, invalid data); 2 the job was cancelled, a usage
#: error, or nothing to talk to; 130 interrupted (Ctrl-C).
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

app = typer.Typer(
    name="lorafleet",
    help="Train LoRA adapters on the GPU nodes that serve your LLMs.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
models_app = typer.Typer(help="The model catalog.", no_args_is_help=True)
jobs_app = typer.Typer(help="Training jobs.", no_args_is_help=True)
app.add_typer(models_app, name="models", rich_help_panel="Catalog")
app.add_typer(jobs_app, name="jobs", rich_help_panel="Jobs")

console = Console()
err = Console(stderr=True)

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


def run_client(fn: Callable[[Client], Awaitable[T]], interrupted: str = "") -> T:
    """Connect, run `fn`, close; a lorafleet error becomes a one-line message
    and its exit code; Ctrl-C exits 130, saying `interrupted` if given."""

    async def main() -> T:
        async with await Client.connect(settings_from_env()) as client:
            return await fn(client)

    try:
        return asyncio.run(main())
    except ApiError as e:
        fail(str(e), EXIT_FAILED)
    except ConnectError as e:
        fail(str(e), EXIT_USAGE)
    except (nats.errors.NoRespondersError, nats.errors.TimeoutError, TimeoutError):
        url = redact_url(settings_from_env().nats_url)
        fail(
            f"no lorafleet service answered on {url}: start them (`lorafleet up`, or "
            "`lorafleet recorder`, `scheduler`, `artifact-store`) or set LORAFLEET_NATS_URL",
            EXIT_USAGE,
        )
    except KeyboardInterrupt:
        if interrupted:
            err.print(interrupted, highlight=False, soft_wrap=True)
        raise typer.Exit(EXIT_INTERRUPTED) from None


def fail(message: str, code: int) -> NoReturn:
    """One line on stderr saying what to change, then exit `code` (no traceback)."""
    err.print(f"[red]error[/red] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def print_json(value: Any) -> None:
    sys.stdout.write(msgspec.json.format(msgspec.json.encode(value)).decode() + "\n")
