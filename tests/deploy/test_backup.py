"""docs/operations.md's backup and restore, its blocks read from the page.

A job runs through the gateway on one stack (nats-server, PostgreSQL, the
services, the gateway, an agent with the stand-in trainer); the page's backup
block saves it with the server stopped; the stack goes; the page's restore
block puts the copies into an empty database and an empty store, and a
fresh stack on them answers for all of it: the job's record, the gateway's
file and job (its KV bucket), and the adapter, downloaded with the sha256
the first stack stored.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
from pathlib import Path

from lorafleet.artifacts import download_artifact
from lorafleet.nats.server import NatsServer
from lorafleet_schemas.messages import ArtifactKind
from lorafleet_services.gateway.api_keys import make_key
from tests.cluster.test_agent_unit import code_blocks
from tests.eventually import eventually
from tests.gateway.conftest import gateway_on, sdk_for
from tests.gateway.sdk_real import FINAL, job_id_of
from tests.gateway.test_sdk_flow import DATA
from tests.pg import throwaway_database
from tests.system.conftest import running_stack, system_settings

DOC = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
#: Seconds the stand-in's job has to succeed.
JOB_TIMEOUT_S = 120.0


def run_block(first_word: str, **env: str) -> None:
    """The page's block whose first line starts with `first_word`, in `sh -e`."""
    (block,) = [b for b in code_blocks(DOC.read_text()) if b.startswith(first_word)]
    done = subprocess.run(["sh", "-e", "-c", block], env=env | {"PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, f"{block}\nexited {done.returncode}: {done.stderr}"


def libpq(url: str) -> str:
    return re.sub(r"^postgresql\+psycopg://", "postgresql://", url)


async def test_a_restored_stack_serves_the_same_jobs_files_and_adapters(
    pg_url: str, tmp_path: Path
) -> None:
    keys_file, backup = tmp_path / "keys.json", tmp_path / "backup"
    backup.mkdir()
    key = make_key(keys_file, "alice")
    first = NatsServer(tmp_path / "store-1")
    await first.start()
    async with running_stack(
        system_settings(first.url, pg_url, tmp_path / "one"), first, tmp_path / "one", "b"
    ) as stack:
        await stack.add_model("tiny")
        await stack.agent("node-1")
        async with gateway_on(stack, keys_file, {}) as (_, url), sdk_for(url, key) as sdk:
            uploaded = await sdk.files.create(file=("pairs.jsonl", DATA), purpose="fine-tune")
            created = await sdk.fine_tuning.jobs.create(
                model="tiny", training_file=uploaded.id,
                extra_body={"lorafleet": {"node": "node-1", "gpu_memory_mib": 1000}},
            )  # fmt: skip
            done = await eventually(
                lambda: sdk.fine_tuning.jobs.retrieve(created.id), "the job to end",
                until=lambda j: j.status in FINAL, timeout_s=JOB_TIMEOUT_S,
            )  # fmt: skip
            assert done.status == "succeeded", done
        kept = await download_artifact(
            stack.js, stack.settings.names, job_id_of(done), ArtifactKind.PEFT, tmp_path / "a"
        )
        await first.stop()
        run_block("pg_dump", DATABASE=libpq(pg_url), STORE_DIR=str(first.store_dir),
                  BACKUP=str(backup))  # fmt: skip
    with throwaway_database("lorafleet_restore", migrate=False) as fresh_url:
        store = tmp_path / "store-2"
        store.mkdir()
        run_block("pg_restore", DATABASE=libpq(fresh_url), STORE_DIR=str(store),
                  BACKUP=str(backup))  # fmt: skip
        second = NatsServer(store)
        await second.start()
        try:
            settings = system_settings(second.url, fresh_url, tmp_path / "two")
            async with (
                running_stack(settings, second, tmp_path / "two", "b") as stack,
                gateway_on(stack, keys_file, {}) as (_, url),
                sdk_for(url, key) as sdk,
            ):
                again = await sdk.fine_tuning.jobs.retrieve(created.id)
                assert again.status == "succeeded", again
                assert again.fine_tuned_model == done.fine_tuned_model
                assert (await sdk.files.content(uploaded.id)).content == DATA
                out = tmp_path / "restored"
                record = await download_artifact(
                    stack.js, stack.settings.names, job_id_of(done), ArtifactKind.PEFT, out
                )
                assert record.sha256 == kept.sha256
                assert hashlib.sha256(out.read_bytes()).hexdigest() == kept.sha256
        finally:
            await second.stop()
