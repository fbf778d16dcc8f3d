"""`lorafleet demo`: the main job, end to end, on the embedded default.

It starts the embedded stack with one local agent that trains on the CPU,
builds a tiny Llama (no download), adds it to the catalog, submits a job
with generated question/answer pairs, follows it, and downloads every
artifact with its sha256 checked. With `--engine llamacpp` (the default)
the adapter is also converted to GGUF (docs/gguf-conversion.md); with
`--serve` it is then served by a real CPU vLLM (demo_serve.py).
"""

from __future__ import annotations

import hashlib
import json
import random
import tempfile
from pathlib import Path

from rich.console import Console

from lorafleet.artifacts import RESULTS, download_name
from lorafleet.client import Client
from lorafleet_schemas.messages import (
    Engine,
    JobSpec,
    JobState,
    ModelSpec,
    TrainerParams,
)
from lorafleet_services.agent.environment.gguf_conversion import local_conversion_source
from lorafleet_services.cli.follow import choose_mode, follow
from lorafleet_services.local.vllm_launch import RunningVllm
from lorafleet_services.stack import (
    DEMO_MEMORY_MIB,
    LOCAL_NODE,
    EmbeddedStack,
    local_agent_config,
)

#: The demo model's catalog name.
DEMO_MODEL = "tiny-llama"
#: `--serve`'s model: the tiny Llama shaped for the CPU vLLM.
SERVED_MODEL = "tiny-llama-vllm"


def demo_records(n: int = 96, seed: int = 7) -> str:
    """Question/answer pairs a tiny model can learn in a minute: small sums."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        lines.append(json.dumps({"q": f"What is {a} plus {b}?", "a": f"{a} plus {b} is {a + b}."}))
    return "\n".join(lines) + "\n"


async def run_demo(
    data_dir: Path | None, out_dir: Path, engine: Engine, console: Console, serve: bool = False
) -> int:
    """Run the demo in `data_dir` (default: a new temporary directory); exit code 0 when
    the job ended done and every artifact arrived in `out_dir` with its sha256 (and,
    with `serve`, its adapter answered from a real vLLM: demo_serve.py)."""
    directory = data_dir or Path(tempfile.mkdtemp(prefix="lorafleet-demo-"))
    console.print(f"data directory: {directory}")
    if not serve:
        return await _run(directory, tiny_model(directory, console), out_dir, engine, console)
    from lorafleet_services.demo_serve import demo_engine

    model_dir = tiny_model(directory, console, SERVED_MODEL)
    async with demo_engine(model_dir, directory, console) as running:
        return await _run(directory, model_dir, out_dir, Engine.VLLM, console, running)


async def _run(
    directory: Path,
    model_dir: Path,
    out_dir: Path,
    engine: Engine,
    console: Console,
    served_by: RunningVllm | None = None,
) -> int:
    if engine is Engine.LLAMACPP:
        console.print("preparing llama.cpp's conversion code (from PyPI's llama-cpp-python) ...")
    agent = await local_agent_config(
        directory,
        LOCAL_NODE,
        prepare=local_conversion_source if engine is Engine.LLAMACPP else None,
    )
    if served_by is not None:  # the agent serves what it trains there
        agent = agent.with_(vllm_servers=(served_by.url,), engines_refresh_s=1.0)
    model = DEMO_MODEL if served_by is None else SERVED_MODEL
    stack = EmbeddedStack(data_dir=directory, agent=agent)
    settings = await stack.start()
    console.print(f"lorafleet is up: NATS {settings.nats_url}")
    try:
        async with await Client.connect(settings) as lf:
            if model not in {m.name for m in await lf.models()}:
                spec = ModelSpec(name=model, engine=engine, local_dir=str(model_dir))
                await lf.add_model(spec)
            job = await lf.submit(demo_job(model, serve=served_by is not None))
            console.print(f"queued job {job.id} ({job.records} records)")
            last = await follow(lf, job.id, choose_mode(False, False, console), console)
            if last.state is not JobState.DONE:
                console.print(f"[red]the job ended {last.state.value}[/red]: {last.message}")
                return 1
            if not await _download_checked(lf, job.id, out_dir, console):
                return 1
            console.print("[green]done[/green]: the adapter trained, arrived and checks out")
            if served_by is not None:
                from lorafleet_services.demo_serve import show_served

                return 0 if await show_served(lf, job.id, served_by, console) else 1
            return 0
    finally:
        await stack.stop()


def demo_job(model: str = DEMO_MODEL, serve: bool | None = None) -> JobSpec:
    """The demo's job: a few epochs of small sums on the local agent's CPU."""
    return JobSpec(
        name="demo",
        model=model,
        serve=serve,
        node=LOCAL_NODE,
        gpu_memory_mib=DEMO_MEMORY_MIB,
        # The estimate at submit is a card's; on the CPU the trainer holds the
        # job to its budget itself.
        ignore_estimate=True,
        data=demo_records(),
        params=TrainerParams(
            rank=8, alpha=16, epochs=4, batch_size=8, learning_rate=3e-3,
            max_seq_len=64, eval_fraction=0.1,
        ),
    )  # fmt: skip


def tiny_model(directory: Path, console: Console, name: str = DEMO_MODEL) -> Path:
    """The tiny Llama under `directory`, built on the spot the first time (no
    download); SERVED_MODEL is shaped for the CPU vLLM (VLLM_CPU_SIZES)."""
    model_dir = directory / "models" / name
    if not (model_dir / "config.json").is_file():
        console.print("building a tiny Llama (no download) ...")
        from transformers.utils import logging as hf_logging

        from lorafleet_services.local.tiny_model import VLLM_CPU_SIZES, build_tiny_model

        hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
        sizes = VLLM_CPU_SIZES if name == SERVED_MODEL else None
        build_tiny_model("llama", model_dir, sizes=sizes)
    return model_dir


async def _download_checked(lf: Client, job_id: str, out_dir: Path, console: Console) -> bool:
    """Download what the job made into `out_dir`; False at the first sha256 mismatch."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for art in await lf.artifacts(job_id):
        if art.kind not in RESULTS:
            continue
        path = out_dir / download_name(job_id, art.kind)
        rec = await lf.download(job_id, art.kind, path)
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        ok = digest == rec.sha256 == art.sha256
        console.print(
            f"  {art.kind.value}: {path} {rec.size} bytes sha256 {digest} "
            + ("[green]checked[/green]" if ok else "[red]MISMATCH[/red]")
        )
        if not ok:
            return False
    return True
