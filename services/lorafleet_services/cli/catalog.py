"""`lorafleet models`: the model catalog."""

from __future__ import annotations

import typer
from rich.table import Table

from lorafleet_schemas.messages import Engine, ModelSpec
from lorafleet_services.cli._app import console, models_app, print_json, run_client


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
    spec = ModelSpec(
        name=name,
        engine=engine,
        hf_repo=hf_repo,
        hf_revision=revision,
        local_dir=local_dir,
        description=description,
    )
    print_json(run_client(lambda c: c.add_model(spec)))


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
