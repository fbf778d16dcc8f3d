"""`lorafleet nodes`: the fleet, and `nodes cordon|drain|uncordon NODE`."""

from __future__ import annotations

import typer
from rich.table import Table

from lorafleet_schemas.messages import NodeInfo, NodeList, NodeSchedule
from lorafleet_services.cli._app import JSON_OPTION, app, run_client, show

nodes_app = typer.Typer(
    help="Nodes heartbeating now, with their cards, jobs and marks; cordon, drain, uncordon.",
    invoke_without_command=True,
)
app.add_typer(nodes_app, name="nodes", rich_help_panel="Fleet")

#: The NODE argument of the mark commands.
NODE_ARGUMENT = typer.Argument(..., metavar="NODE", help="The node's name (`lorafleet nodes`).")


@nodes_app.callback()
def nodes(ctx: typer.Context, as_json: bool = JSON_OPTION) -> None:
    """Nodes heartbeating now, with their cards, jobs and marks."""
    if ctx.invoked_subcommand is None:
        show(run_client(lambda c: c.nodes()), as_json, nodes_table)


@nodes_app.command("list")
def nodes_list(as_json: bool = JSON_OPTION) -> None:
    """Nodes heartbeating now (as `lorafleet nodes`)."""
    show(run_client(lambda c: c.nodes()), as_json, nodes_table)


@nodes_app.command("cordon")
def nodes_cordon(node: str = NODE_ARGUMENT, as_json: bool = JSON_OPTION) -> None:
    """No new training on NODE (a job it runs finishes); what it serves stays."""
    _mark(node, NodeSchedule.CORDONED, as_json)


@nodes_app.command("drain")
def nodes_drain(
    node: str = NODE_ARGUMENT,
    move_training: bool = typer.Option(
        False,
        "--move-training",
        help="Also resume NODE's training jobs elsewhere from a checkpoint taken at the move "
        "(docs/operations.md); refused while one that has trained has none, unless --force.",
    ),
    force: bool = typer.Option(
        False,
        "--force",
        help="With --move-training: move a job with no checkpoint too.",
    ),
    as_json: bool = JSON_OPTION,
) -> None:
    """Cordon NODE, place its replicas elsewhere, then unload them there; a
    training job there finishes, or with --move-training resumes elsewhere."""
    _mark(node, NodeSchedule.DRAINED, as_json, move_training=move_training, force=force)


@nodes_app.command("uncordon")
def nodes_uncordon(node: str = NODE_ARGUMENT, as_json: bool = JSON_OPTION) -> None:
    """Open NODE again to training and to replicas."""
    _mark(node, NodeSchedule.OPEN, as_json)


def _mark(
    node: str, schedule: NodeSchedule, as_json: bool, *, move_training: bool = False,
    force: bool = False,
) -> None:  # fmt: skip
    reply = run_client(
        lambda c: c.schedule_node(node, schedule, move_training=move_training, force=force)
    )
    show(reply, as_json, mark_line)


def mark_line(info: NodeInfo) -> str:
    heard = "alive" if info.alive else "not heartbeating now"
    lines = [f"node {info.heartbeat.node} is {info.schedule.value} ({heard})"]
    lines += [f"job {j} moves: it resumes on another node" for j in info.moving]
    lines += [f"job {j} stays: {why}" for j, why in info.staying.items()]
    return "\n".join(lines)


def nodes_table(reply: NodeList) -> Table:
    table = Table("node", "alive", "schedule", "job", "cards", "engines", "last beat")
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
            n.schedule.value + (", training moves" if n.move_training else ""),
            hb.job or "-",
            cards or ("cpu" if hb.cpu_training else "none"),
            engines or "-",
            hb.time.isoformat(timespec="seconds"),
        )
    return table
