"""`lorafleet nodes`: the fleet."""

from __future__ import annotations

from rich.table import Table

from lorafleet_schemas.messages import NodeList
from lorafleet_services.cli._app import JSON_OPTION, app, run_client, show


@app.command("nodes", rich_help_panel="Fleet")
def nodes(as_json: bool = JSON_OPTION) -> None:
    """Nodes heartbeating now, with their cards and jobs."""
    show(run_client(lambda c: c.nodes()), as_json, nodes_table)


def nodes_table(reply: NodeList) -> Table:
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
    return table
