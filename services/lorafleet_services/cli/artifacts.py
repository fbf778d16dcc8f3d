"""`lorafleet artifacts` and `download`: what a job made."""

from __future__ import annotations

from pathlib import Path

import msgspec
import typer
from rich.table import Table

from lorafleet.artifacts import (
    RESULTS,
    ArtifactDigestError,
    ArtifactNotFoundError,
    download_name,
)
from lorafleet.client import Client
from lorafleet.exits import Exit
from lorafleet_schemas.messages import ArtifactKind, ArtifactRecord, GcReport
from lorafleet_services.cli._app import (
    JOB_ARGUMENT,
    JSON_OPTION,
    app,
    err,
    fail,
    print_json,
    run_client,
    show,
    unwritable,
    writable_dir,
)
from lorafleet_services.cli.follow import human_bytes


class Downloaded(msgspec.Struct):
    """One file `download` wrote, as its --json prints it."""

    path: str
    artifact: ArtifactRecord


def artifacts_table(stored: list[ArtifactRecord]) -> Table:
    table = Table("kind", "size", "sha256", "node", "stored", title=f"artifacts ({len(stored)})")
    for a in stored:
        stored_at = a.stored_at.astimezone().strftime("%Y-%m-%d %H:%M:%S")
        table.add_row(a.kind.value, human_bytes(a.size), a.sha256, a.node, stored_at)
    return table


@app.command("artifacts", rich_help_panel="Artifacts")
def artifacts(job_id: str = JOB_ARGUMENT, as_json: bool = JSON_OPTION) -> None:
    """A job's stored artifacts: kind, size, sha256 (and a checkpoint's step)."""
    show(run_client(lambda c: c.artifacts(job_id)), as_json, artifacts_table)


@app.command("download", rich_help_panel="Artifacts")
def download(
    job_id: str = JOB_ARGUMENT,
    kind: list[ArtifactKind] = typer.Option(
        [],
        metavar="|".join(ArtifactKind),
        help="Repeatable. Default: what the job made (peft, gguf); a checkpoint only when named.",
    ),
    out: Path = typer.Option(Path("."), help="Directory to write into."),
    as_json: bool = JSON_OPTION,
) -> None:
    """Download a job's artifacts (sha256 checked), a line per file on stderr."""

    async def go(c: Client) -> list[Downloaded]:
        kinds = kind or [a.kind for a in await c.artifacts(job_id) if a.kind in RESULTS]
        writable_dir(out, "--out")
        files = []
        for k in kinds:
            path = out / download_name(job_id, k)
            try:
                rec = await c.download(job_id, k, path)
            except (ArtifactNotFoundError, ArtifactDigestError) as e:
                fail(str(e), Exit.REFUSED)
            except OSError as e:
                unwritable(path, "--out", e)
            # A person's view, as each file arrives; --json adds the list on stdout.
            err.print(f"{path}  {rec.size} bytes  sha256 {rec.sha256} (checked)", highlight=False)
            files.append(Downloaded(str(path), rec))
        return files

    files = run_client(go)
    if as_json:
        print_json(files)


@app.command("gc", rich_help_panel="Artifacts")
def gc(
    dry_run: bool = typer.Option(
        False, "--dry-run", help="List what would be removed, and why; remove nothing."
    ),
    as_json: bool = JSON_OPTION,
) -> None:
    """Remove the artifacts and datasets nothing needs (docs/operations.md, "Retention")."""
    reports = run_client(lambda c: c.gc(dry_run))
    show(reports, as_json, gc_view)
    refused = [r.refused for r in reports if r.refused]
    if refused:
        fail(" / ".join(refused), Exit.REFUSED)


def gc_view(reports: list[GcReport]) -> Table:
    dry = reports[0].dry_run if reports else False
    removed = [i for r in reports for i in r.removed]
    waiting = [i for r in reports for i in r.waiting]
    freed = sum(r.freed_bytes for r in reports)
    verb = "would remove" if dry else "removed"
    table = Table(
        "object", "kind", "size", "", "why", title=(
            f"{verb} {len(removed)} objects ({human_bytes(freed)}); "
            f"{len(waiting)} in their grace; {sum(r.examined for r in reports)} looked at"
        ),
    )  # fmt: skip
    for item, when in [(i, verb) for i in removed] + [(i, "grace") for i in waiting]:
        table.add_row(f"{item.bucket}/{item.object}", item.kind, human_bytes(item.size),
                      when, item.reason)  # fmt: skip
    return table
