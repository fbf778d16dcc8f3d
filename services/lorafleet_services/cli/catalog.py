"""`lorafleet models`: the model catalog."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from lorafleet.estimate import with_architecture
from lorafleet.exits import Exit
from lorafleet_schemas.messages import Engine, ModelRecord, ModelSpec
from lorafleet_services.cli._app import (
    DEMO_ENGINE,
    JSON_OPTION,
    err,
    fail,
    models_app,
    run_client,
    settings_from_env,
    show,
    unwritable,
)


@models_app.command("add")
def models_add(
    name: str = typer.Argument(..., metavar="NAME", help="The model's name in the catalog."),
    engine: Engine = typer.Option(..., help="What serves this model on the nodes."),
    hf_repo: str | None = typer.Option(None, help="Hugging Face repo id."),
    revision: str = typer.Option("main", help="Branch, tag or commit of --hf-repo."),
    local_dir: str | None = typer.Option(None, help="Directory of the weights on the nodes."),
    description: str = typer.Option("", help="A line about the model, for the catalog."),
    as_json: bool = JSON_OPTION,
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
    show(run_client(lambda c: c.add_model(spec, read_architecture=False)), as_json, model_table)


def models_table(models: list[ModelRecord]) -> Table:
    table = Table("name", "engine", "weights", "description")
    for m in models:
        weights = m.local_dir or f"{m.hf_repo}@{m.hf_revision}"
        table.add_row(m.name, m.engine.value, weights, m.description)
    return table


def model_table(model: ModelRecord) -> Table:
    return models_table([model])


@models_app.command("list")
def models_list(as_json: bool = JSON_OPTION) -> None:
    """The catalog."""
    show(run_client(lambda c: c.models()), as_json, models_table)


@models_app.command("add-demo")
def models_add_demo(
    engine: Engine = typer.Option(
        DEMO_ENGINE, help="What serves it: llamacpp also makes a GGUF (fetches code once)."
    ),
    as_json: bool = JSON_OPTION,
) -> None:
    """Build the demo's tiny Llama in the data directory (no download), add it
    to the catalog as tiny-llama, and write the demo's question/answer pairs
    next to it (for `lorafleet submit --data`). Needs lorafleet[train]."""
    from lorafleet_services.demo import DEMO_MODEL, demo_records, tiny_model
    from lorafleet_services.stack import DEMO_DATA_FILE, DEMO_MEMORY_MIB

    directory = Path(settings_from_env().data_dir)
    try:
        model_dir = tiny_model(directory, err)
    except ImportError as e:
        fail(
            f"building the tiny model needs transformers ({e}): pip install 'lorafleet[train]'",
            Exit.REFUSED,
        )
    except OSError as e:
        unwritable(directory, "the data directory (LORAFLEET_DATA_DIR)", e)
    data = directory / DEMO_DATA_FILE
    try:
        data.write_text(demo_records())
    except OSError as e:
        unwritable(data, "the data directory (LORAFLEET_DATA_DIR)", e)
    spec = ModelSpec(name=DEMO_MODEL, engine=engine, local_dir=str(model_dir))
    show(run_client(lambda c: c.add_model(spec)), as_json, model_table)
    err.print(
        f"next: lorafleet submit --model {DEMO_MODEL} --gpu-memory-mib {DEMO_MEMORY_MIB}"
        f" --data {data} --watch",
        highlight=False,
    )
