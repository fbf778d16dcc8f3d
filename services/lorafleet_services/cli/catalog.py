"""`lorafleet models`: the model catalog."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from lorafleet.estimate import with_architecture
from lorafleet_schemas.messages import Engine, ModelSpec
from lorafleet_services.cli._app import (
    console,
    err,
    fail,
    models_app,
    print_json,
    run_client,
    settings_from_env,
)


@models_app.command("add")
def models_add(
    name: str,
    engine: Engine = typer.Option(..., help="What serves this model on the nodes."),
    hf_repo: str | None = typer.Option(None, help="Hugging Face repo id."),
    revision: str = typer.Option("main", help="Branch, tag or commit of --hf-repo."),
    local_dir: str | None = typer.Option(None, help="Directory of the weights on the nodes."),
    description: str = typer.Option(""),
) -> None:
    """Add a model to the catalog, with its architecture (config.json's sizes,
    for the memory estimate) when --local-dir or the Hugging Face cache here
    holds it."""
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


@models_app.command("add-demo")
def models_add_demo(
    engine: Engine = typer.Option(Engine.VLLM, help="llamacpp also makes a GGUF (fetches code)."),
) -> None:
    """Build the demo's tiny Llama in the data directory (no download), add it
    to the catalog as tiny-llama, and write the demo's question/answer pairs
    next to it (for `lorafleet submit --data`). Needs lorafleet[train]."""
    from lorafleet_services.demo import DEMO_MODEL, demo_records, tiny_model
    from lorafleet_services.stack import DEMO_DATA_FILE

    directory = Path(settings_from_env().data_dir)
    try:
        model_dir = tiny_model(directory, err)
    except ImportError as e:
        fail(f"building the tiny model needs transformers ({e}): pip install 'lorafleet[train]'", 2)
    data = directory / DEMO_DATA_FILE
    data.write_text(demo_records())
    spec = ModelSpec(name=DEMO_MODEL, engine=engine, local_dir=str(model_dir))
    print_json(run_client(lambda c: c.add_model(spec)))
    err.print(
        f"next: lorafleet submit --model {DEMO_MODEL} --gpu-mib 1 --data {data} --watch",
        highlight=False,
    )
