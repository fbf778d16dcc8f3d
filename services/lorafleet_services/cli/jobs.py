"""Jobs: `submit`, `jobs list|get|curve`, `watch`, `cancel`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import typer
from rich.table import Table

from lorafleet.client import Client
from lorafleet_schemas.messages import JobListRequest, JobRecord, JobSpec, JobState, TrainerParams
from lorafleet_services.cli._app import app, console, err, jobs_app, print_json, run_client


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
    gpu_mib: int = typer.Option(..., help="MiB of one card the job needs."),
    data: Path = typer.Option(..., help="NDJSON of {q, a} or {messages} records."),
    node: str | None = typer.Option(None, help="The node to train on (default: placed)."),
    name: str = typer.Option("", help="A name for the job."),
    param: list[str] = typer.Option([], help="Trainer parameter key=value; repeatable."),
    params: Path | None = typer.Option(None, help="Trainer parameters as a JSON file."),
    watch_: bool = typer.Option(False, "--watch", help="Follow the job to its end."),
) -> None:
    """Queue a training job. Data over 512 KiB goes to the datasets bucket first."""
    body = data.read_bytes()
    trainer = parse_params(param, params)

    async def go(c: Client) -> JobRecord:
        if len(body) > 512 * 1024:
            spec = JobSpec(
                model=model,
                gpu_memory_mib=gpu_mib,
                node=node,
                name=name,
                dataset=await c.upload_dataset(body),
                params=trainer,
            )
        else:
            spec = JobSpec(
                model=model,
                gpu_memory_mib=gpu_mib,
                node=node,
                name=name,
                data=body.decode(),
                params=trainer,
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
