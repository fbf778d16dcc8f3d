"""`lorafleet artifacts` and `download`: what a job made."""

from __future__ import annotations

from pathlib import Path

import typer

from lorafleet.artifacts import (
    RESULTS,
    ArtifactDigestError,
    ArtifactNotFoundError,
    download_name,
)
from lorafleet.client import Client
from lorafleet_schemas.messages import ArtifactKind
from lorafleet_services.cli._app import EXIT_FAILED, app, err, fail, print_json, run_client


@app.command("artifacts", rich_help_panel="Artifacts")
def artifacts(job_id: str) -> None:
    """A job's stored artifacts, as JSON."""
    print_json(run_client(lambda c: c.artifacts(job_id)))


@app.command("download", rich_help_panel="Artifacts")
def download(
    job_id: str,
    kind: list[ArtifactKind] = typer.Option(
        [],
        metavar="|".join(ArtifactKind),
        help="Repeatable. Default: what the job made (peft, gguf); a checkpoint only when named.",
    ),
    out: Path = typer.Option(Path("."), help="Directory to write into."),
) -> None:
    """Download a job's artifacts (sha256 checked)."""

    async def go(c: Client) -> None:
        kinds = kind or [a.kind for a in await c.artifacts(job_id) if a.kind in RESULTS]
        out.mkdir(parents=True, exist_ok=True)
        for k in kinds:
            path = out / download_name(job_id, k)
            try:
                rec = await c.download(job_id, k, path)
            except (ArtifactNotFoundError, ArtifactDigestError) as e:
                fail(str(e), EXIT_FAILED)
            err.print(f"{path}  {rec.size} bytes  sha256 {rec.sha256} (checked)")

    run_client(go)
