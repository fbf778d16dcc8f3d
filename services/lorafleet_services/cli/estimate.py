"""`lorafleet estimate`, the trainer parameters every job command reads
(`parse_params`), and the memory estimate as the command shows it
(estimate, submit --dry-run): `estimate_text` is plain text in, plain text
out, so that it is tested without a bus or a terminal."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import typer

from lorafleet.exits import Exit
from lorafleet_schemas.messages import JobEstimate, JobEstimateRequest, TrainerParams
from lorafleet_services.cli._app import (
    JSON_OPTION,
    app,
    fail,
    print_json,
    read_input,
    run_client,
)


def estimate_text(answer: JobEstimate, gpu_memory_mib: int | None = None) -> str:
    """The estimate line by line with its total and margin; or why there is none.
    With `gpu_memory_mib`, whether it fits and, when not, what to change."""
    est = answer.estimate
    if est is None:
        return f"no memory estimate for model {answer.model}: {answer.reason}"
    width = max(len(x.name) for x in est.lines)
    rows = [
        f"memory estimate for model {answer.model} ({est.dtype}, rows of {est.seq_len} tokens):"
    ]
    rows += [f"  {x.name:<{width}}  {x.mib:>10.1f} MiB  {x.note}" for x in est.lines]
    rows.append(f"  {'total':<{width}}  {est.total_mib:>10} MiB")
    rows.append(
        f"  with the {est.margin_fraction:.0%} margin: {est.recommended_mib} MiB "
        "(what a submit without --gpu-memory-mib asks for)"
    )
    if gpu_memory_mib is not None:
        rows.append(
            f"--gpu-memory-mib {gpu_memory_mib} fits the estimate"
            if answer.fits
            else f"refused: {answer.reason}"
        )
    return "\n".join(rows)


def params_file_values(path: Path) -> dict[str, Any]:
    """The object a --params file holds; one line and Exit.BAD_FILE when the
    file cannot be read or holds no JSON object."""
    text = read_input(path, "--params")
    try:
        values = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        fail(f"--params {path}: not JSON ({e}): write one JSON object", Exit.BAD_FILE)
    if not isinstance(values, dict):
        fail(
            f"--params {path}: holds a JSON {type(values).__name__}, not an object: "
            'write one object such as {"rank": 8, "epochs": 2}',
            Exit.BAD_FILE,
        )
    try:
        msgspec.convert(values, TrainerParams)
    except msgspec.ValidationError as e:
        fail(f"--params {path}: {e}", Exit.BAD_FILE)
    return values


def parse_params(pairs: list[str], params_file: Path | None) -> TrainerParams:
    """--params FILE (JSON) and --param key=value (value as JSON, else text)."""
    raw: dict[str, Any] = {}
    if params_file is not None:
        raw.update(params_file_values(params_file))
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            fail(f"--param {pair!r}: write it as key=value", Exit.USAGE)
        try:
            raw[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            raw[key.strip()] = value
    try:
        return msgspec.convert(raw, TrainerParams)
    except msgspec.ValidationError as e:
        fail(f"--param: trainer parameters: {e}", Exit.USAGE)


def show_estimate(model: str, trainer: TrainerParams, gpu_mib: int | None) -> None:
    """Print the job's memory estimate; Exit.REFUSED when there is none or gpu_mib is below it."""
    request = JobEstimateRequest(model=model, params=trainer, gpu_memory_mib=gpu_mib)
    answer = run_client(lambda c: c.estimate(request))
    print(estimate_text(answer, gpu_mib))
    if answer.estimate is None or not answer.fits:
        raise typer.Exit(Exit.REFUSED)


@app.command("estimate", rich_help_panel="Jobs")
def estimate_cmd(
    model: str = typer.Option(..., help="The catalog model the adapter is for."),
    gpu_memory_mib: int | None = typer.Option(
        None, help="Check this many MiB against the estimate."
    ),
    param: list[str] = typer.Option(
        [], metavar="KEY=VALUE", help="A trainer parameter; repeatable."
    ),
    params: Path | None = typer.Option(
        None, help="Trainer parameters as a JSON file (an object); --param wins."
    ),
    as_json: bool = JSON_OPTION,
) -> None:
    """The peak card memory of a job, line by line; nothing is queued."""
    trainer = parse_params(param, params)
    if not as_json:
        show_estimate(model, trainer, gpu_memory_mib)
        return
    request = JobEstimateRequest(model=model, params=trainer, gpu_memory_mib=gpu_memory_mib)
    print_json(run_client(lambda c: c.estimate(request)))
