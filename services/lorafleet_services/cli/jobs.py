"""Jobs: `submit`, `jobs list|get|show|curve|delete`, `watch`, `cancel`, `resume`."""

from __future__ import annotations

from pathlib import Path

import msgspec
import typer
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from lorafleet.client import Client
from lorafleet.exits import Exit
from lorafleet_schemas.messages import (
    ArtifactRecord,
    JobCurve,
    JobListRequest,
    JobRecord,
    JobSpec,
    JobState,
)
from lorafleet_services.cli._app import (
    JOB_ARGUMENT,
    JSON_OPTION,
    SERVING_OPTION,
    app,
    console,
    err,
    fail,
    jobs_app,
    print_json,
    read_input,
    run_client,
    serving_policy,
    show,
    unwritable,
)
from lorafleet_services.cli.estimate import parse_params, show_estimate
from lorafleet_services.cli.follow import (
    PLAIN_EVERY_S,
    choose_mode,
    duration,
    exit_code,
    follow,
    follow_serving,
    human_bytes,
    preference_words,
)
from lorafleet_services.cli.plots import PlotsMissingError, terminal_plot, write_png

_PARAM = typer.Option([], metavar="KEY=VALUE", help="A trainer parameter; repeatable.")
_MAX_ATTEMPTS = typer.Option(
    1,
    min=1,
    max=100,
    help="Attempts in all (the job's max_attempts): with attempts left, a lost job resumes "
    "from its newest checkpoint.",
)
_RESUME_FROM = typer.Option(
    None,
    metavar="JOB",
    help="Start from that job's newest checkpoint (else its adapter) and train on this data.",
)
_EVAL_DATA = typer.Option(
    None,
    help="An evaluation set (the same records): the eval loss is computed on it and "
    "every record of --data is trained on (eval_fraction unused).",
)
_PARAMS = typer.Option(None, help="Trainer parameters as a JSON file (an object); --param wins.")
_METHOD = typer.Option(
    None,
    "--method",
    metavar="supervised|dpo",
    help="What the records train (params.method): supervised or dpo (preference pairs; "
    "--param beta=0.1). Default: supervised, or the --params file's.",
)
_SUBMIT_JSON = typer.Option(
    False,
    "--json",
    help="Print JSON on stdout: the job's record; with --watch, every event as a JSON line.",
)
_SERVE = typer.Option(
    None,
    "--serve/--no-serve",
    help="Load the adapter into the node's engines once done (default: where one runs the model).",
)


@app.command("submit", rich_help_panel="Jobs")
def submit(
    model: str = typer.Option(..., help="The catalog model the adapter is for."),
    gpu_memory_mib: int | None = typer.Option(
        None, help="MiB of one card the job needs (default: the memory estimate + its margin)."
    ),
    data: Path = typer.Option(
        ..., help="NDJSON records ({q, a}, {messages}; --method dpo: pairs)."
    ),
    eval_data: Path | None = _EVAL_DATA,
    node: str | None = typer.Option(None, help="The node to train on (default: placed)."),
    name: str = typer.Option("", help="A name for the job."),
    param: list[str] = _PARAM,
    params: Path | None = _PARAMS,
    method: str | None = _METHOD,
    watch_: bool = typer.Option(False, "--watch", help="Follow the job to its end."),
    plain: bool = typer.Option(False, "--plain", help="With --watch: lines, no live display."),
    as_json: bool = _SUBMIT_JSON,
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Show the memory estimate; queue nothing."
    ),
    ignore_estimate: bool = typer.Option(
        False, help="Queue even when --gpu-memory-mib is below the memory estimate."
    ),
    max_attempts: int = _MAX_ATTEMPTS,
    resume_from: str | None = _RESUME_FROM,
    serve: bool | None = _SERVE,
    serving: str | None = SERVING_OPTION,
) -> None:
    """Queue a training job. Data (and an evaluation set) over 512 KiB goes
    to the datasets bucket first."""
    body = read_input(data, "--data")
    eval_body = None if eval_data is None else read_input(eval_data, "--eval-data")
    trainer = parse_params(param + ([f"method={method}"] if method else []), params)
    if dry_run:
        show_estimate(model, trainer, gpu_memory_mib)
        return
    spec = JobSpec(
        model=model,
        gpu_memory_mib=gpu_memory_mib,
        node=node,
        name=name,
        params=trainer,
        ignore_estimate=ignore_estimate,
        max_attempts=max_attempts,
        resume_from=resume_from,
        serve=serve,
        serving=serving_policy(serving),
    )

    async def go(c: Client) -> JobRecord:
        job = await c.submit(await c.with_data(spec, body, eval_body))
        held = f", {job.eval_records} to evaluate on" if job.eval_dataset else ""
        err.print(f"queued job [bold]{job.id}[/bold] ({job.records} records{held})")
        if watch_:
            return await follow(c, job.id, choose_mode(plain, as_json, err), err)
        return job

    job = run_client(go, interrupted="stopped watching; the job goes on (`lorafleet jobs list`)")
    _submitted(job, watch_, as_json)


def _submitted(job: JobRecord, watched: bool, as_json: bool) -> None:
    """The job as queued (after a watch the summary said it all); after a
    watch, the exit code says how the job ended."""
    if not watched:
        show(job, as_json, lambda j: job_details(j, []))
        return
    raise typer.Exit(exit_code(job))


@jobs_app.command("list")
def jobs_list(
    state: JobState | None = typer.Option(None, help="Only jobs in this state."),
    node: str | None = typer.Option(None, help="Only jobs placed on this node."),
    model: str | None = typer.Option(None, help="Only jobs of this catalog model."),
    limit: int = typer.Option(50, min=1, help="At most this many jobs."),
    as_json: bool = JSON_OPTION,
) -> None:
    """Jobs, newest first."""
    req = JobListRequest(state=state, node=node, model=model, limit=limit)
    show(run_client(lambda c: c.jobs(req)), as_json, jobs_table)


def jobs_table(jobs: list[JobRecord]) -> Table:
    table = Table("id", "name", "model", "node", "state", "step", "loss", "peak MiB", "message")
    for j in jobs:
        table.add_row(
            j.id,
            j.name,
            j.model,
            j.node or "-",
            j.state.value,
            f"{j.step}/{j.steps}" if j.steps else "",
            f"{j.loss:.4g}" if j.loss is not None else "",
            str(j.peak_mib or ""),
            j.message,
        )
    return table


@jobs_app.command("get")
def jobs_get(job_id: str = JOB_ARGUMENT, as_json: bool = JSON_OPTION) -> None:
    """One job's record."""
    show(run_client(lambda c: c.get(job_id)), as_json, lambda job: job_details(job, []))


class JobShown(msgspec.Struct):
    """What `jobs show` shows, as its --json prints it."""

    job: JobRecord
    curve: JobCurve
    artifacts: list[ArtifactRecord]


@jobs_app.command("delete")
def jobs_delete(
    job_id: str = JOB_ARGUMENT,
    reason: str = typer.Option("", help="Why, for the recorder's log (job.deleted)."),
    as_json: bool = JSON_OPTION,
) -> None:
    """Forget a final job (its record, events, curves): `lorafleet gc` then
    removes its artifacts and the data no other job or file names."""
    show(run_client(lambda c: c.delete(job_id, reason)), as_json,
         lambda job: f"deleted job {job.id} ({job.state.value})")  # fmt: skip


@jobs_app.command("show")
def jobs_show(
    job_id: str = JOB_ARGUMENT,
    png: Path | None = typer.Option(None, "--png", help="Also write the loss plot to this PNG."),
    as_json: bool = JSON_OPTION,
) -> None:
    """Everything about a job: its record, state changes, artifacts, and the
    loss curve drawn in the terminal (--png FILE writes it as an image too)."""

    async def go(c: Client) -> JobShown:
        return JobShown(await c.get(job_id), await c.curve(job_id), await c.artifacts(job_id))

    shown = run_client(go)
    show(shown, as_json, lambda s: job_page(s.job, s.curve, s.artifacts))
    if png is not None:
        try:
            write_png(shown.job, shown.curve, png)
        except PlotsMissingError as e:
            fail(str(e), Exit.REFUSED)
        except OSError as e:
            unwritable(png, "--png", e)
        err.print(f"wrote {png}")


def job_page(job: JobRecord, curve: JobCurve, stored: list[ArtifactRecord]) -> Group:
    """`jobs show` for a person: the details, the state changes, the curves."""
    parts: list[RenderableType] = [job_details(job, stored)]
    parts += [job_history(curve)] if curve.events else []
    parts.append(curve_view(job, curve))
    return Group(*parts)


def curve_view(job: JobRecord, curve: JobCurve) -> RenderableType:
    if not curve.points:
        return Text("no loss points yet", style="dim")
    return Text.from_ansi(terminal_plot(job, curve, console.width - 2))


def job_details(job: JobRecord, stored: list[ArtifactRecord]) -> Table:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    took = (
        (job.finished_at - (job.started_at or job.created_at)).total_seconds()
        if job.finished_at
        else None
    )
    rows = [
        ("job", f"{job.id}" + (f" ({job.name})" if job.name else "")),
        ("state", job.state.value + (f": {job.message}" if job.message else "")),
        ("model", f"{job.model} ({job.engine.value})"),
        (
            "node",
            f"{job.node or 'not placed'}, {job.gpu_memory_mib} MiB asked, "
            f"attempt {job.attempt} of {job.max_attempts}",
        ),
        ("checkpoint", checkpoint_line(job)),
        ("data", f"{job.records} records, {job.dataset}"),
        ("eval data", eval_data_line(job)),
        ("params", ", ".join(f"{k}={v}" for k, v in msgspec.structs.asdict(job.params).items())),
        ("progress", f"step {job.step}/{job.steps}" if job.steps else "-"),
        ("loss", f"{job.loss:.4g}" if job.loss is not None else "-"),
        ("eval loss", f"{job.eval_loss:.4g}" if job.eval_loss is not None else "-"),
        *preference_rows(job),
        ("peak", f"{job.peak_mib} MiB" if job.peak_mib else "-"),
        ("created", job.created_at.isoformat(timespec="seconds")),
        ("took", duration(took) if took is not None else "-"),
    ]
    rows += [
        (f"artifact {a.kind.value}", f"{human_bytes(a.size)}  sha256 {a.sha256}") for a in stored
    ]
    for key, value in rows:
        table.add_row(key, Text(value))
    return table


def preference_rows(job: JobRecord) -> list[tuple[str, str]]:
    """A DPO job's newest reward margin and preference accuracy, on its
    steps and on the held-out pairs (none for a supervised job)."""
    if job.params.method != "dpo":
        return []
    return [
        ("preference", preference_words(job.preference or {}, "") or "-"),
        ("eval preference", preference_words(job.eval_preference or {}, "eval_") or "-"),
    ]


def eval_data_line(job: JobRecord) -> str:
    """What the eval loss is computed on: the job's evaluation set, or a held-out share."""
    if job.eval_dataset is None:
        return f"{job.params.eval_fraction:.0%} of the data held out (eval_fraction)"
    return f"{job.eval_records} records, {job.eval_dataset}"


def checkpoint_line(job: JobRecord) -> str:
    """The job's newest checkpoint, and what it started from."""
    cp = job.checkpoint
    said = (
        f"step {cp.step} (attempt {cp.attempt}, {human_bytes(cp.size)})" if cp is not None else "-"
    )
    if job.resume_from is not None:
        said += f"; started from job {job.resume_from}"
    return said


def job_history(curve: JobCurve) -> Table:
    table = Table("time", "from", "to", "message", title="state changes", title_justify="left")
    for e in curve.events:
        table.add_row(
            e.time.astimezone().strftime("%H:%M:%S"),
            e.from_state.value if e.from_state else "",
            e.to_state.value,
            e.message,
        )
    return table


@jobs_app.command("curve")
def jobs_curve(job_id: str = JOB_ARGUMENT, as_json: bool = JSON_OPTION) -> None:
    """A job's loss and eval-loss points and its state changes (drawn, or
    with --json every point)."""
    if as_json:
        print_json(run_client(lambda c: c.curve(job_id)))
        return

    async def go(c: Client) -> JobShown:
        return JobShown(await c.get(job_id), await c.curve(job_id), [])

    shown = run_client(go)
    console.print(Group(job_history(shown.curve), curve_view(shown.job, shown.curve)))


@app.command("watch", rich_help_panel="Jobs")
def watch(
    job_id: str = JOB_ARGUMENT,
    plain: bool = typer.Option(False, "--plain", help="Lines, no live display."),
    as_json: bool = typer.Option(False, "--json", help="The events as JSON lines on stdout."),
    every_s: float = typer.Option(
        PLAIN_EVERY_S, "--every-s", min=0.1, help="Plain: a progress line at least this often."
    ),
    until_served: bool = typer.Option(
        False, "--until-served", help="After done: follow its serving until it settles."
    ),
    serve_timeout_s: float = typer.Option(
        300.0, "--serve-timeout-s", min=1, help="With --until-served: the longest wait."
    ),
) -> None:
    """Follow a job until it ends: a live display on a terminal, a line per
    state change and per tenth of the steps otherwise. The exit code says how
    it ended (the table at the end of `lorafleet --help`)."""
    mode = choose_mode(plain, as_json, err)

    async def go(c: Client) -> int:
        job = await follow(c, job_id, mode, err, every_s=every_s)
        if until_served and job.state == JobState.DONE:
            return await follow_serving(c, job, mode, err, serve_timeout_s)
        return exit_code(job)

    code = run_client(
        go, interrupted=f"stopped watching; job {job_id} goes on (`lorafleet cancel` stops it)"
    )
    raise typer.Exit(code)


_REASON = typer.Option("", help="Why, for the job's history.")


def job_line(job: JobRecord) -> Text:
    """A job in one line: what `cancel` and `resume` leave it as."""
    said = f"job {job.id} {job.state.value}" + (f": {job.message}" if job.message else "")
    return Text(said)


@app.command("cancel", rich_help_panel="Jobs")
def cancel(job_id: str = JOB_ARGUMENT, reason: str = _REASON, as_json: bool = JSON_OPTION) -> None:
    """Cancel a job: a queued one is never sent, a running one is stopped on its node."""
    show(run_client(lambda c: c.cancel(job_id, reason)), as_json, job_line)


@app.command("resume", rich_help_panel="Jobs")
def resume(
    job_id: str = JOB_ARGUMENT,
    attempts: int = typer.Option(
        1,
        "--attempts",
        min=1,
        max=100,
        help="More attempts, from now on (the API's attempts: its max_attempts grows so "
        "that this many are left).",
    ),
    reason: str = _REASON,
    as_json: bool = JSON_OPTION,
) -> None:
    """Queue a failed or cancelled job again from its newest checkpoint, as a
    new attempt. A job with no checkpoint cannot resume: submit a new job
    with --resume-from JOB to start from its adapter."""
    show(run_client(lambda c: c.resume(job_id, attempts, reason)), as_json, job_line)
