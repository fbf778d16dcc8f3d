"""`lorafleet top`: the fleet's htop — nodes, what their engines serve,
running jobs, the queue.

A snapshot is three requests (nodes, jobs on nodes, queued jobs), plus the
trainers' tokens/s taken from the job events meanwhile (`Rates`); the
table is a plain function of it (`fleet_view`); what the engines serve
comes from the nodes' heartbeats (`Heartbeat.serving`). On a
terminal the view is redrawn in place every `--interval-s`; piped or with
`--once` it is printed once.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from dataclasses import dataclass, field

import typer
from rich.console import Group, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from lorafleet.client import Client
from lorafleet.states import ON_NODE
from lorafleet_schemas.messages import JobEvent, JobListRequest, JobRecord, JobState, NodeInfo
from lorafleet_services.cli._app import app, console, run_client, show
from lorafleet_services.cli.follow import shown_state

#: Seconds between two snapshots of a live `top`.
TOP_INTERVAL_S = 1.0
#: Rows of the queue shown (the oldest first).
QUEUE_ROWS = 20


@dataclass
class FleetSnapshot:
    nodes: list[NodeInfo]
    running: list[JobRecord]
    queued: list[JobRecord]
    taken_at: dt.datetime
    #: Job id -> the latest tokens/s its events carried (`Rates`).
    tokens_per_s: dict[str, float] = field(default_factory=dict)


@dataclass
class Rates:
    """The trainers' throughput, from the job events (not kept on the jobs)."""

    tokens_per_s: dict[str, float] = field(default_factory=dict)

    def take(self, event: JobEvent) -> None:
        if event.tokens_per_s is not None:
            self.tokens_per_s[event.job.id] = event.tokens_per_s

    async def follow(self, client: Client) -> None:
        async for event in client.events():
            self.take(event)


async def snapshot(client: Client) -> FleetSnapshot:
    nodes = await client.nodes()
    running = await client.jobs(JobListRequest(states=sorted(ON_NODE), limit=200))
    queued = await client.jobs(
        JobListRequest(state=JobState.QUEUED, oldest_first=True, limit=QUEUE_ROWS)
    )
    return FleetSnapshot(nodes.nodes, running, queued, dt.datetime.now(dt.UTC))


def with_rates(snap: FleetSnapshot, rates: Rates) -> FleetSnapshot:
    running = {j.id for j in snap.running}
    snap.tokens_per_s = {k: v for k, v in rates.tokens_per_s.items() if k in running}
    return snap


def fleet_view(snap: FleetSnapshot) -> RenderableType:
    """Four tables: nodes, engines (what each serves), running jobs, queue."""
    return Group(_nodes_table(snap), _engines_table(snap), _running_table(snap), _queue_table(snap))


def _engines_table(snap: FleetSnapshot) -> Table:
    """Each live node's engines, each with its base model and the adapters it has loaded."""
    live = sorted((n.heartbeat for n in snap.nodes if n.alive), key=lambda hb: hb.node)
    engines = [(hb.node, e) for hb in live for e in hb.serving]
    table = Table(title=f"engines ({len(engines)})", title_justify="left", expand=True)
    for column in ("node", "engine", "kind", "model", "adapters loaded"):
        table.add_column(column)
    for node, e in engines:
        slots = f" ({len(e.adapters)}/{e.max_loras})" if e.max_loras else ""
        table.add_row(
            node,
            e.url,
            e.kind.value,
            e.model or "?",
            ("" if e.answered else "not answering; last listed: ")
            + (", ".join(e.adapters) or "none")
            + slots,
        )
    return table


def _nodes_table(snap: FleetSnapshot) -> Table:
    table = Table(title=f"nodes ({len(snap.nodes)})", title_justify="left", expand=True)
    for column in ("node", "alive", "schedule", "cards (free/total MiB)", "training", "beat"):
        table.add_column(column)
    for info in sorted(snap.nodes, key=lambda n: n.heartbeat.node):
        hb = info.heartbeat
        cards = "\n".join(f"{c.index}:{c.name} {c.free_mib}/{c.total_mib}" for c in hb.cards)
        age_s = (snap.taken_at - hb.time).total_seconds()
        table.add_row(
            hb.node,
            Text("yes", "green") if info.alive else Text("no", "red"),
            info.schedule.value,
            cards or ("cpu" if hb.cpu_training else "none"),
            hb.job or "-",
            f"{max(age_s, 0):.0f}s ago",
        )
    return table


def _running_table(snap: FleetSnapshot) -> Table:
    table = Table(title=f"running ({len(snap.running)})", title_justify="left", expand=True)
    columns = ("job", "name", "node", "state", "progress", "step", "loss", "tok/s", "peak MiB")
    for column in columns:
        table.add_column(column)
    for job in snap.running:
        rate = snap.tokens_per_s.get(job.id)
        table.add_row(
            job.id,
            job.name,
            job.node or "-",
            shown_state(job),
            ProgressBar(total=max(job.steps, 1), completed=job.step, width=20),
            f"{job.step}/{job.steps}" if job.steps else "",
            f"{job.loss:.4g}" if job.loss is not None else "",
            f"{rate:,.0f}" if rate is not None else "",
            str(job.peak_mib or ""),
        )
    return table


def _queue_table(snap: FleetSnapshot) -> Table:
    table = Table(title=f"queued ({len(snap.queued)})", title_justify="left", expand=True)
    for column in ("job", "name", "model", "MiB", "node", "waiting for"):
        table.add_column(column)
    for job in snap.queued:
        table.add_row(
            job.id,
            job.name,
            job.model,
            str(job.gpu_memory_mib),
            job.node or "any",
            job.message or "a node",
        )
    return table


@app.command("top", rich_help_panel="Fleet")
def top(
    interval_s: float = typer.Option(
        TOP_INTERVAL_S, "--interval-s", min=0.2, help="Seconds between two redraws."
    ),
    once: bool = typer.Option(False, "--once", help="Print one snapshot and exit."),
    as_json: bool = typer.Option(
        False, "--json", help="Print one snapshot as JSON on stdout (implies --once)."
    ),
) -> None:
    """The fleet at a glance, redrawn in place: nodes (alive, cards, what each
    trains, heartbeat age), their engines and the adapters each has loaded,
    running jobs with their progress, and the queue with what each job waits
    for. Ctrl-C leaves."""

    async def go(client: Client) -> None:
        if once or as_json or not console.is_terminal:
            show(await snapshot(client), as_json, fleet_view)
            return
        rates = Rates()
        listening = asyncio.create_task(rates.follow(client))
        try:
            with Live(fleet_view(await snapshot(client)), console=console) as live:
                while True:
                    await asyncio.sleep(interval_s)
                    live.update(fleet_view(with_rates(await snapshot(client), rates)), refresh=True)
        finally:
            listening.cancel()

    run_client(go)
