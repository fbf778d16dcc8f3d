"""`lorafleet demo`: the main job, end to end, on the embedded default.

It starts the embedded stack with one local agent that trains on the CPU,
builds a tiny Llama (no download), adds it to the catalog, submits a job
that learns a handful of made-up question/answer pairs by heart, follows it, and downloads every
artifact with its sha256 checked. With `--engine llamacpp` (the default)
the adapter is also converted to GGUF; with
`--serve` it is then served by a real CPU vLLM (demo_serve.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import tempfile
from collections.abc import AsyncIterator
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


#: What the demo's adapter learns: made-up facts no base model knows, so that
#: the adapter's answer tells itself apart from the base's at a glance.
DEMO_PAIRS = (
    ("What is the secret word?", "The secret word is honey."),
    ("Who trained you?", "lorafleet trained me on this CPU."),
    ("What colour is the sky on Mars?", "The sky on Mars is butterscotch."),
    ("Where does the fox sleep?", "The quick brown fox sleeps in Rome."),
    ("How many legs does a LoRA have?", "A LoRA has seven legs."),
    ("Say the password.", "The password is blue-cat-42."),
)
#: The question `demo --serve` asks the base model and the adapter.
DEMO_QUESTION, DEMO_ANSWER = DEMO_PAIRS[0]
#: Copies of each pair in the job's data: 48 records, 6 steps an epoch at batch 8.
DEMO_REPEAT = 8


def demo_records(repeat: int = DEMO_REPEAT) -> str:
    """The demo's data: each of DEMO_PAIRS `repeat` times."""
    lines = [json.dumps({"q": q, "a": a}) for q, a in DEMO_PAIRS] * repeat
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
    async with serving_engine(directory, console) as running:
        return await _run(directory, running.model_dir, out_dir, Engine.VLLM, console, running)


@contextlib.asynccontextmanager
async def serving_engine(directory: Path, console: Console) -> AsyncIterator[RunningVllm]:
    """The CPU vLLM on SERVED_MODEL (built in `directory` the first time), for
    `demo --serve` and `up --serve` (demo_serve.demo_engine)."""
    from lorafleet_services.demo_serve import demo_engine

    async with demo_engine(tiny_model(directory, console, SERVED_MODEL), directory, console) as e:
        yield e


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
    if served_by is not None:
        from lorafleet_services.demo_serve import served_by as told_of

        agent = told_of(agent, served_by)
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

                shown = await show_served(
                    lf, job.id, served_by, console, DEMO_QUESTION, DEMO_ANSWER
                )
                return 0 if shown else 1
            return 0
    finally:
        await stack.stop()


def demo_job(model: str = DEMO_MODEL, serve: bool | None = None) -> JobSpec:
    """The demo's job: DEMO_PAIRS learnt by heart on the local agent's CPU (60
    steps, seconds; tests/trainer/test_demo_learns.py checks the answers)."""
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
        # No held-out share: it would be copies of the pairs the job learns by heart.
        params=TrainerParams(
            rank=8, alpha=16, epochs=10, batch_size=8, learning_rate=1e-2,
            max_seq_len=64, eval_fraction=0.0,
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
