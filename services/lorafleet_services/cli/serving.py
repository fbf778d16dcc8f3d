"""`lorafleet serve`, `unserve` and `adapters`: a done job's adapter on the
nodes' engines, and where each is served.

`serve` and `unserve` print what each node took on (the engines it will
load into, or why none); the loads' outcomes follow as serving records,
which `adapters` lists as a table (`adapters_table`, a plain function).
"""

from __future__ import annotations

import datetime as dt

import typer
from rich.table import Table
from rich.text import Text

from lorafleet_schemas.messages import NodeServeReply, ServingRecord, ServingState
from lorafleet_services.cli._app import JOB_ARGUMENT, JSON_OPTION, app, run_client, show

#: How each state is drawn: what is served in green, what needs a person in red.
STATE_STYLES = {
    ServingState.SERVED: "green",
    ServingState.LOADING: "yellow",
    ServingState.REFUSED: "red",
    ServingState.FAILED: "red",
    ServingState.RESTART_REQUIRED: "magenta",
    ServingState.UNLOADED: "dim",
}


ADAPTER_COLUMNS = (
    "job", "node", "engine", "served name", "state", "reason / lift", "probe", "updated",
)  # fmt: skip


def reply_line(job_id: str, verb: str, reply: NodeServeReply) -> str:
    """One line per node: which engines it took the request on for, or why none."""
    if reply.engines:
        return f"{job_id}: node {reply.node} {verb} {', '.join(reply.engines)}"
    return f"{job_id}: node {reply.node} {verb} nothing: {reply.reason or 'no reason given'}"


def adapters_table(records: list[ServingRecord], now: dt.datetime) -> Table:
    """Job, node, engine, served name, state, reason (and what lifts it),
    probe error, and how long ago it changed."""
    table = Table(title=f"adapters ({len(records)})", title_justify="left")
    for column in ADAPTER_COLUMNS:
        table.add_column(column)
    for r in records:
        why = r.reason + (f"\nlift: {r.lift}" if r.lift else "")
        age_s = max(0.0, (now - r.updated_at).total_seconds())
        table.add_row(
            r.job_id,
            r.node,
            r.engine,
            r.served_name,
            Text(r.state.value, STATE_STYLES.get(r.state, "")),
            why or "-",
            f"{r.probe_error:.2g}" if r.probe_error is not None else "-",
            f"{age_s:.0f}s ago",
        )
    return table


@app.command("serve", rich_help_panel="Serving")
def serve(
    job_id: str = JOB_ARGUMENT,
    node: str | None = typer.Option(None, "--node", help="Default: the node it trained on."),
    engine: str | None = typer.Option(
        None, "--engine", help="One engine's URL on that node (`lorafleet top` lists them)."
    ),
    as_json: bool = JSON_OPTION,
) -> None:
    """Load a done job's adapter into a node's running engines that serve its
    model. `lorafleet adapters --job JOB` shows how each load ends."""
    reply = run_client(lambda c: c.serve(job_id, node, engine))
    show(reply, as_json, lambda r: Text(reply_line(job_id, "loads into", r)))


@app.command("unserve", rich_help_panel="Serving")
def unserve(
    job_id: str = JOB_ARGUMENT,
    node: str | None = typer.Option(None, "--node", help="Default: every node serving it."),
    engine: str | None = typer.Option(None, "--engine", help="One engine's URL on that node."),
    as_json: bool = JSON_OPTION,
) -> None:
    """Take a job's adapter out of the engines serving it."""
    reply = run_client(lambda c: c.unserve(job_id, node, engine))
    show(
        reply,
        as_json,
        lambda r: Text("\n".join(reply_line(job_id, "unloads from", one) for one in r.replies)),
    )


@app.command("adapters", rich_help_panel="Serving")
def adapters(
    job: list[str] = typer.Option(
        [], "--job", metavar="JOB", help="This job only; repeat for several."
    ),
    node: str | None = typer.Option(None, "--node", help="Only this node's records."),
    model: str | None = typer.Option(None, "--model", help="Only adapters of this base model."),
    state: ServingState | None = typer.Option(None, "--state", help="Only records in this state."),
    as_json: bool = JSON_OPTION,
) -> None:
    """Where adapters are served: a serving record per job, node and engine,
    newest change first, with why one is refused and the flag that would lift it."""
    records = run_client(lambda c: c.adapters(job, node=node, model=model, state=state))
    show(records, as_json, lambda rs: adapters_table(rs, dt.datetime.now(dt.UTC)))
