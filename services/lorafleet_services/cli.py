"""The `lorafleet` command.

Services:   lorafleet up | demo | recorder | scheduler | artifact-store | agent --node NAME
Catalog:    lorafleet models add NAME --engine vllm|llamacpp
                (--hf-repo R [--revision V] | --local-dir D)
            lorafleet models list
Jobs:       lorafleet submit --model M [--gpu-mib N] --data FILE [--dry-run]
                [--node N] [--param key=value ...] [--watch] [--ignore-estimate]
            lorafleet estimate --model M [--param key=value ...] [--gpu-mib N]
            lorafleet jobs list|get|curve ...,  lorafleet watch ID,  lorafleet cancel ID
Nodes:      lorafleet nodes
Artifacts:  lorafleet artifacts ID,  lorafleet download ID [--kind peft|gguf] [--out DIR]
NATS:       lorafleet nats-config --node N [--node N ...] [--blocks]

Without LORAFLEET_NATS_URL the commands use the NATS server of a running
`lorafleet up` (its URL is kept in the data directory).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import typer
from rich.console import Console
from rich.table import Table

from lorafleet.client import Client
from lorafleet.errors import ApiError, ConnectError
from lorafleet.estimate import with_architecture
from lorafleet.settings import Settings
from lorafleet_schemas.messages import (
    ArtifactKind,
    Engine,
    JobEstimateRequest,
    JobListRequest,
    JobRecord,
    JobSpec,
    JobState,
    ModelSpec,
    TrainerParams,
)
from lorafleet_services.agent.config import AgentConfig
from lorafleet_services.agent.conversion import ConversionError, local_conversion_source
from lorafleet_services.estimate_view import estimate_text
from lorafleet_services.stack import (
    LOCAL_NODE,
    ConversionPreparer,
    EmbeddedStack,
    local_agent_config,
)

T = TypeVar("T")

app = typer.Typer(
    name="lorafleet",
    help="Train LoRA adapters on the GPU nodes that serve your LLMs.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
models_app = typer.Typer(help="The model catalog.", no_args_is_help=True)
jobs_app = typer.Typer(help="Training jobs.", no_args_is_help=True)
app.add_typer(models_app, name="models")
app.add_typer(jobs_app, name="jobs")

console = Console()
err = Console(stderr=True)

#: `lorafleet up` listens here unless told otherwise (4222 is often taken).
EMBEDDED_NATS_PORT = 4250
#: Seconds between two looks of `lorafleet up` at its children.
UP_WATCH_INTERVAL_S = 0.5


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


def run_client(fn: Callable[[Client], Awaitable[T]]) -> T:
    """Connect, run `fn`, close; a lorafleet error becomes a one-line message and exit 1."""

    async def main() -> T:
        async with await Client.connect(settings_from_env()) as client:
            return await fn(client)

    try:
        return asyncio.run(main())
    except ApiError as e:
        err.print(f"[red]error[/red] {e}")
        raise typer.Exit(1) from None
    except ConnectError as e:
        err.print(f"[red]error[/red] {e}")
        raise typer.Exit(2) from None


def print_json(value: Any) -> None:
    sys.stdout.write(msgspec.json.format(msgspec.json.encode(value)).decode() + "\n")


# --- services ---------------------------------------------------------------


@app.command("recorder")
def recorder_cmd() -> None:
    """Run the recorder (the system of record) until SIGTERM."""
    from lorafleet import _runtime as runtime
    from lorafleet_services.recorder.service import PROGRAM

    runtime.main(PROGRAM)


@app.command("scheduler")
def scheduler_cmd() -> None:
    """Run the scheduler until SIGTERM."""
    from lorafleet import _runtime as runtime
    from lorafleet_services.scheduler.service import PROGRAM

    runtime.main(PROGRAM)


@app.command("artifact-store")
def artifact_store_cmd() -> None:
    """Run the artifact-store until SIGTERM."""
    from lorafleet import _runtime as runtime
    from lorafleet_services.artifact_store.service import PROGRAM

    runtime.main(PROGRAM)


@app.command("agent")
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

    runtime.main(program(runtime.read_or_exit("agent", lambda: AgentConfig.from_env(**overrides))))


@app.command("up")
def up_cmd(
    data_dir: Path | None = typer.Option(None, help="Default: LORAFLEET_DATA_DIR."),
    nats_port: int = typer.Option(EMBEDDED_NATS_PORT, help="The embedded nats-server's port."),
    node: str = typer.Option(LOCAL_NODE, help="The local agent's node name."),
    agent: bool = typer.Option(True, help="Run a local agent."),
) -> None:
    """Run all of lorafleet on this machine (embedded NATS, SQLite, one agent)."""
    from lorafleet import log

    base = Settings.from_env()
    directory = data_dir or Path(base.data_dir)
    log.configure("up", base.log_level)

    async def main() -> None:
        config = await up_agent_config(directory, node) if agent else None
        stack = EmbeddedStack(
            data_dir=directory, nats_port=nats_port, agent=config, echo=sys.stderr
        )
        settings = await stack.start()
        err.print(
            f"[green]lorafleet is up[/green]: NATS {settings.nats_url}, "
            f"database {settings.effective_database_url}; Ctrl-C stops it"
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            while not stop.is_set():
                if stack.crashed():
                    err.print(f"[red]stopped[/red]: {', '.join(stack.crashed())} exited")
                    break
                await asyncio.sleep(UP_WATCH_INTERVAL_S)
        finally:
            await stack.stop()

    asyncio.run(main())


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


@app.command("demo")
def demo_cmd(
    data_dir: Path | None = typer.Option(None, help="Default: a new temporary directory."),
    out: Path = typer.Option(Path("lorafleet-demo-artifacts"), help="Where artifacts go."),
    engine: Engine = typer.Option(Engine.LLAMACPP, help="llamacpp also makes a GGUF."),
) -> None:
    """The main job on the embedded default: train a tiny model's adapter on
    the CPU through the whole system, then download and check its artifacts."""
    from lorafleet_services.demo import run_demo

    code = asyncio.run(run_demo(data_dir=data_dir, out_dir=out, engine=engine, console=err))
    raise typer.Exit(code)


# --- catalog ----------------------------------------------------------------


@models_app.command("add")
def models_add(
    name: str,
    engine: Engine = typer.Option(..., help="What serves this model on the nodes."),
    hf_repo: str | None = typer.Option(None, help="Hugging Face repo id."),
    revision: str = typer.Option("main", help="Branch, tag or commit of --hf-repo."),
    local_dir: str | None = typer.Option(None, help="Directory of the weights on the nodes."),
    description: str = typer.Option(""),
) -> None:
    """Add a model to the catalog."""
    spec, note = with_architecture(
        ModelSpec(
            name=name,
            engine=engine,
            hf_repo=hf_repo,
            hf_revision=revision,
            local_dir=local_dir,
            description=description,
        )
    )
    if note:
        err.print(f"[yellow]note[/yellow] {note}")
    print_json(run_client(lambda c: c.add_model(spec, read_architecture=False)))


@models_app.command("list")
def models_list(as_json: bool = typer.Option(False, "--json")) -> None:
    """The catalog."""
    models = run_client(lambda c: c.models())
    if as_json:
        print_json(models)
        return
    table = Table("name", "engine", "weights")
    for m in models:
        table.add_row(m.name, m.engine.value, m.local_dir or f"{m.hf_repo}@{m.hf_revision}")
    console.print(table)


# --- jobs -------------------------------------------------------------------


def parse_params(pairs: list[str], params_file: Path | None) -> TrainerParams:
    """--params FILE (JSON) and --param key=value (value as JSON, else text)."""
    raw: dict[str, Any] = {}
    if params_file is not None:
        raw.update(json.loads(params_file.read_text()))
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise typer.BadParameter(f"--param {pair!r}: write it as key=value")
        try:
            raw[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            raw[key.strip()] = value
    try:
        return msgspec.convert(raw, TrainerParams)
    except msgspec.ValidationError as e:
        raise typer.BadParameter(f"trainer parameters: {e}") from None


@app.command("submit")
def submit(
    model: str = typer.Option(..., help="The catalog model the adapter is for."),
    gpu_mib: int | None = typer.Option(
        None, help="MiB of one card the job needs (default: the memory estimate + its margin)."
    ),
    data: Path = typer.Option(..., help="NDJSON of {q, a} or {messages} records."),
    node: str | None = typer.Option(None, help="The node to train on (default: placed)."),
    name: str = typer.Option("", help="A name for the job."),
    param: list[str] = typer.Option([], help="Trainer parameter key=value; repeatable."),
    params: Path | None = typer.Option(None, help="Trainer parameters as a JSON file."),
    watch_: bool = typer.Option(False, "--watch", help="Follow the job to its end."),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Show the memory estimate; queue nothing."
    ),
    ignore_estimate: bool = typer.Option(
        False, help="Queue even when --gpu-mib is below the memory estimate."
    ),
) -> None:
    """Queue a training job. Data over 512 KiB goes to the datasets bucket first."""
    body = data.read_bytes()
    trainer = parse_params(param, params)
    if dry_run:
        show_estimate(model, trainer, gpu_mib)
        return

    async def go(c: Client) -> JobRecord:
        if len(body) > 512 * 1024:
            spec = JobSpec(
                model=model,
                gpu_memory_mib=gpu_mib,
                node=node,
                name=name,
                dataset=await c.upload_dataset(body),
                params=trainer,
                ignore_estimate=ignore_estimate,
            )
        else:
            spec = JobSpec(
                model=model,
                gpu_memory_mib=gpu_mib,
                node=node,
                name=name,
                data=body.decode(),
                params=trainer,
                ignore_estimate=ignore_estimate,
            )
        job = await c.submit(spec)
        err.print(f"queued job [bold]{job.id}[/bold] ({job.records} records)")
        if watch_:
            return await _follow(c, job.id)
        return job

    job = run_client(go)
    print_json(job)
    if watch_ and job.state is not JobState.DONE:
        raise typer.Exit(1)


def show_estimate(model: str, trainer: TrainerParams, gpu_mib: int | None) -> None:
    """Print the job's memory estimate; exit 1 when there is none or gpu_mib is below it."""
    request = JobEstimateRequest(model=model, params=trainer, gpu_memory_mib=gpu_mib)
    answer = run_client(lambda c: c.estimate(request))
    print(estimate_text(answer, gpu_mib))
    if answer.estimate is None or not answer.fits:
        raise typer.Exit(1)


@app.command("estimate")
def estimate_cmd(
    model: str = typer.Option(..., help="The catalog model the adapter is for."),
    gpu_mib: int | None = typer.Option(None, help="Check this many MiB against the estimate."),
    param: list[str] = typer.Option([], help="Trainer parameter key=value; repeatable."),
    params: Path | None = typer.Option(None, help="Trainer parameters as a JSON file."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """The peak card memory of a job, line by line; nothing is queued."""
    trainer = parse_params(param, params)
    if not as_json:
        show_estimate(model, trainer, gpu_mib)
        return
    request = JobEstimateRequest(model=model, params=trainer, gpu_memory_mib=gpu_mib)
    print_json(run_client(lambda c: c.estimate(request)))


def _progress_line(job: JobRecord) -> str:
    parts = [f"{job.state.value:<10}"]
    if job.steps:
        parts.append(f"step {job.step}/{job.steps}")
    if job.loss is not None:
        parts.append(f"loss {job.loss:.4f}")
    if job.eval_loss is not None:
        parts.append(f"eval {job.eval_loss:.4f}")
    if job.peak_mib:
        parts.append(f"peak {job.peak_mib} MiB")
    if job.message:
        parts.append(f"- {job.message}")
    return "  ".join(parts)


async def _follow(c: Client, job_id: str) -> JobRecord:
    last: JobRecord | None = None
    async for event in c.watch(job_id):
        last = event.job
        err.print(_progress_line(event.job))
    # watch() yields the job's record first; a stream that ended empty reads it again.
    return last if last is not None else await c.get(job_id)


@jobs_app.command("list")
def jobs_list(
    state: JobState | None = typer.Option(None),
    node: str | None = typer.Option(None),
    model: str | None = typer.Option(None),
    limit: int = typer.Option(50),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Jobs, newest first."""
    req = JobListRequest(state=state, node=node, model=model, limit=limit)
    jobs = run_client(lambda c: c.jobs(req))
    if as_json:
        print_json(jobs)
        return
    table = Table("id", "name", "model", "node", "state", "step", "loss", "peak MiB", "message")
    for j in jobs:
        table.add_row(
            j.id,
            j.name,
            j.model,
            j.node or "-",
            j.state.value,
            f"{j.step}/{j.steps}" if j.steps else "",
            f"{j.loss:.4f}" if j.loss is not None else "",
            str(j.peak_mib or ""),
            j.message,
        )
    console.print(table)


@jobs_app.command("get")
def jobs_get(job_id: str) -> None:
    """One job, as JSON."""
    print_json(run_client(lambda c: c.get(job_id)))


@jobs_app.command("curve")
def jobs_curve(job_id: str) -> None:
    """A job's loss curve and state changes, as JSON."""
    print_json(run_client(lambda c: c.curve(job_id)))


@app.command("watch")
def watch(job_id: str) -> None:
    """Follow a job until it ends; exit 0 when it is done."""
    job = run_client(lambda c: _follow(c, job_id))
    raise typer.Exit(0 if job.state is JobState.DONE else 1)


@app.command("cancel")
def cancel(job_id: str, reason: str = typer.Option("")) -> None:
    """Cancel a job: a queued one is never sent, a running one is stopped on its node."""
    print_json(run_client(lambda c: c.cancel(job_id, reason)))


@app.command("nodes")
def nodes(as_json: bool = typer.Option(False, "--json")) -> None:
    """Nodes heartbeating now, with their cards and jobs."""
    reply = run_client(lambda c: c.nodes())
    if as_json:
        print_json(reply)
        return
    table = Table("node", "alive", "job", "cards", "engines", "last beat")
    for n in reply.nodes:
        hb = n.heartbeat
        cards = ", ".join(f"{c.index}:{c.name} {c.free_mib}/{c.total_mib} MiB" for c in hb.cards)
        engines = ", ".join(
            [f"vllm {v}" for v in hb.engines.vllm]
            + ([f"llama.cpp {hb.engines.llamacpp}"] if hb.engines.llamacpp else [])
        )
        table.add_row(
            hb.node,
            "yes" if n.alive else "no",
            hb.job or "-",
            cards or ("cpu" if hb.cpu_training else "none"),
            engines or "-",
            hb.time.isoformat(timespec="seconds"),
        )
    console.print(table)


@app.command("artifacts")
def artifacts(job_id: str) -> None:
    """A job's stored artifacts, as JSON."""
    print_json(run_client(lambda c: c.artifacts(job_id)))


@app.command("download")
def download(
    job_id: str,
    kind: list[ArtifactKind] = typer.Option([], help="Default: every artifact of the job."),
    out: Path = typer.Option(Path("."), help="Directory to write into."),
) -> None:
    """Download a job's artifacts (sha256 checked)."""

    async def go(c: Client) -> None:
        kinds = kind or [a.kind for a in await c.artifacts(job_id)]
        out.mkdir(parents=True, exist_ok=True)
        for k in kinds:
            suffix = ".tar.gz" if k is ArtifactKind.PEFT else ".gguf"
            path = out / f"{job_id}-{k.value}{suffix}"
            rec = await c.download(job_id, k, path)
            err.print(f"{path}  {rec.size} bytes  sha256 {rec.sha256} (checked)")

    run_client(go)


# --- NATS credentials ---------------------------------------------------------


@app.command("nats-config")
def nats_config_cmd(
    node: list[str] = typer.Option(..., "--node", help="A node's name; repeat for each node."),
    listen: str = typer.Option("0.0.0.0:4222", help="host:port the server listens on."),
    host: str = typer.Option("127.0.0.1:4222", help="host:port the processes connect to."),
    store_dir: str | None = typer.Option(None, help="JetStream's store directory."),
    blocks: bool = typer.Option(False, "--blocks", help="Only the permission blocks, as JSON."),
) -> None:
    """Print a nats-server config: a user for the services and one per node,
    each node allowed only its own subjects (passwords generated), then the
    LORAFLEET_* settings each process runs with, as comments."""
    import secrets

    from lorafleet import permissions as perms

    names = Settings.from_env().names
    try:
        passwords = {u: secrets.token_urlsafe(18) for u in (perms.SERVICE_USER, *node)}
        users = perms.fleet_users(names, node, passwords)
    except ValueError as e:
        err.print(f"[red]error[/red] {e}")
        raise typer.Exit(1) from None
    if blocks:
        print_json({user: block for user, (_pw, block) in users.items()})
        return
    lines = [perms.server_config(users, listen=listen, store_dir=store_dir)]
    lines.append("# Each process's settings (keep this file and these lines secret):")
    for user, (password, _block) in users.items():
        agent = None if user == perms.SERVICE_USER else user
        lines.append(f"#   {user}: {perms.client_env(user, password, host, node=agent)}")
    sys.stdout.write("\n".join(lines) + "\n")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
