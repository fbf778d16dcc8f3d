"""`lorafleet nodes`: the fleet."""

from __future__ import annotations

import typer
from rich.table import Table

from lorafleet_services.cli._app import app, console, print_json, run_client


@app.command("nodes", rich_help_panel="Fleet")
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
