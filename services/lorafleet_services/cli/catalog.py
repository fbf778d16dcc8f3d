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
    SERVING_OPTION,
    err,
    fail,
    models_app,
    run_client,
    serving_policy,
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
    serving: str | None = SERVING_OPTION,
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
            serving=serving_policy(serving),
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
    engine: Engine | None = typer.Option(
        None,
        help="What serves it: llamacpp (the default) also makes a GGUF (fetches code once); "
        "vllm is the default while `up --serve` runs its CPU vLLM.",
    ),
    as_json: bool = JSON_OPTION,
) -> None:
    """Build the demo's tiny Llama in the data directory, add it to the
    catalog as tiny-llama (as tiny-llama-vllm while `lorafleet up --serve`
    runs) and write the demo's pairs next to it. Needs lorafleet[train]."""
    from lorafleet_services.demo import DEMO_MODEL, SERVED_MODEL, demo_records, tiny_model
    from lorafleet_services.stack import DEMO_DATA_FILE, DEMO_MEMORY_MIB, VLLM_URL_FILE

    directory = Path(settings_from_env().data_dir)
    vllm_url = _serving_vllm(directory / VLLM_URL_FILE)
    engine = engine or (Engine.VLLM if vllm_url else DEMO_ENGINE)
    name = SERVED_MODEL if vllm_url and engine is Engine.VLLM else DEMO_MODEL
    try:
        model_dir = tiny_model(directory, err, name)
    except ImportError as e:
        fail(
            f"building the tiny model needs transformers ({e}): pip install 'lorafleet[train]'",
            Exit.REFUSED,
        )
    except OSError as e:
        unwritable(directory, "the data directory (--data-dir, LORAFLEET_DATA_DIR)", e)
    data = directory / DEMO_DATA_FILE
    try:
        data.write_text(demo_records())
    except OSError as e:
        unwritable(data, "the data directory (--data-dir, LORAFLEET_DATA_DIR)", e)
    spec = ModelSpec(name=name, engine=engine, local_dir=str(model_dir))
    show(run_client(lambda c: c.add_model(spec)), as_json, model_table)
    if name == SERVED_MODEL:
        err.print(f"served by the CPU vLLM at {vllm_url}, as each adapter of it will be")
    err.print(
        f"next: lorafleet submit --model {name} --gpu-memory-mib {DEMO_MEMORY_MIB}"
        f" --data {data} --watch",
        highlight=False,
    )


#: Seconds `models add-demo` gives the CPU vLLM of `up --serve` to answer /health.
VLLM_HEALTH_TIMEOUT_S = 2.0


def _serving_vllm(url_file: Path) -> str:
    """The URL of the CPU vLLM `up --serve` runs, when its file is there and it
    answers; "" otherwise (none, or the file of one killed with its `up`)."""
    import urllib.error
    import urllib.request

    try:
        url = url_file.read_text().strip()
        with urllib.request.urlopen(f"{url}/health", timeout=VLLM_HEALTH_TIMEOUT_S) as answer:
            return url if answer.status == 200 else ""
    except (OSError, ValueError, urllib.error.URLError):
        return ""
