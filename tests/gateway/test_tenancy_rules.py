"""The rules of tenancy.py, adapter_wait.py and api_keys.py as plain code:
no bus, no HTTP (their behaviour through the SDK: test_tenancy.py)."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest

from lorafleet.errors import ConflictError
from lorafleet.exits import Exit
from lorafleet_schemas.messages import Engine, JobRecord, JobState, ServingRecord, ServingState
from lorafleet_services.gateway.adapter_wait import REPORT_GRACE_S, on_its_way
from lorafleet_services.gateway.api_keys import (
    ApiKeysError,
    Caller,
    KeyRing,
    KeysFileError,
    make_key,
    read_keys,
    revoke_key,
)
from lorafleet_services.gateway.config import GatewayConfig, GatewayConfigError
from lorafleet_services.gateway.context import GatewayContext
from lorafleet_services.gateway.tenancy import quota_exceeded, undo_refused_job
from tests.gateway.test_job_mapping import T0, record

LATER = T0 + dt.timedelta(seconds=1)


def serving(state: ServingState, at: dt.datetime = T0) -> ServingRecord:
    return ServingRecord(
        job_id="j1", node="n", engine="http://e", engine_kind=Engine.VLLM, model="tiny",
        served_name="j1-abc", sha256="a" * 64, state=state, created_at=T0, updated_at=at,
    )  # fmt: skip


def done(serve: bool | None = None) -> JobRecord:
    return record(JobState.DONE, finished_at=T0, serve=serve)


def test_an_adapter_is_on_its_way_while_loading_or_just_finished() -> None:
    job = done()
    assert on_its_way(job, [serving(ServingState.LOADING)], True, LATER)
    # A load under way beats an older refusal on another engine.
    both = [serving(ServingState.REFUSED), serving(ServingState.LOADING, LATER)]
    assert on_its_way(job, both, True, LATER)
    # No record yet: coming while the agent may still report, if an engine serves the base.
    assert on_its_way(job, [], True, LATER)
    late = T0 + dt.timedelta(seconds=REPORT_GRACE_S + 1)
    assert not on_its_way(job, [], True, late)
    assert not on_its_way(job, [], False, LATER)


@pytest.mark.parametrize(
    "state", [ServingState.REFUSED, ServingState.FAILED, ServingState.UNLOADED]
)
def test_a_record_that_says_it_will_not_come_ends_the_wait(state: ServingState) -> None:
    assert not on_its_way(done(), [serving(state)], True, LATER)


def test_no_wait_for_a_job_not_done_or_not_to_be_served() -> None:
    assert not on_its_way(record(JobState.RUNNING), [], True, LATER)
    assert not on_its_way(done(serve=False), [], True, LATER)


def test_a_quota_message_names_the_quota_its_limit_and_setting() -> None:
    assert quota_exceeded("jobs in flight", 1, 1, 2, "S") is None
    assert quota_exceeded("jobs in flight", 9, 1, None, "S") is None
    said = quota_exceeded("jobs in flight", 2, 1, 2, "LORAFLEET_X")
    assert said and "jobs in flight is 2 and it has 2" in said and "LORAFLEET_X" in said
    bytes_said = quota_exceeded("bytes uploaded", 10, 5, 12, "S")
    assert bytes_said and "(this request adds 5)" in bytes_said


class Undo:
    """A gateway's client and bucket for `undo_refused_job`: what it did, in order."""

    def __init__(self, conflicts: int) -> None:
        self.conflicts, self.done = conflicts, list[str]()
        self.ctx = cast(GatewayContext, SimpleNamespace(client=self, state=self))

    async def cancel(self, job_id: str, reason: str) -> None:
        if self.conflicts:
            self.conflicts -= 1
            self.done.append("conflict")
            raise ConflictError("the job moved on")
        self.done.append("cancel")

    async def delete(self, job_id: str, reason: str) -> None:
        self.done.append("delete")

    async def delete_job(self, project: str, job_id: str) -> None:
        self.done.append("entry")


async def test_a_refused_job_is_cancelled_again_and_leaves_its_project_last() -> None:
    """Before, the project's entry went first and a lost cancel left the job
    queued outside any project."""
    undo = Undo(conflicts=2)
    await undo_refused_job(undo.ctx, "p", "j1", "over")
    assert undo.done == ["conflict", "conflict", "cancel", "delete", "entry"]
    stuck = Undo(conflicts=3)
    with pytest.raises(ConflictError):
        await undo_refused_job(stuck.ctx, "p", "j1", "over")
    assert "entry" not in stuck.done  # still the project's to see and cancel


def test_keys_belong_to_projects_and_a_revoked_key_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    old = make_key(path, "alice")  # as before projects: its own
    team = make_key(path, "ci", project="alice")
    ring = KeyRing(path)
    assert ring.caller_of(old) is not None and ring.caller_of(old).project == "alice"  # type: ignore[union-attr]
    assert ring.caller_of(team) is not None and ring.caller_of(team).project == "alice"  # type: ignore[union-attr]
    assert revoke_key(path, "ci").project_name == "alice"
    assert ring.caller_of(team) is None and ring.caller_of(old) is not None
    assert [k.name for k in read_keys(path).keys] == ["alice"]
    with pytest.raises(ApiKeysError, match="no API key 'ci'"):
        revoke_key(path, "ci")


def test_a_name_that_would_join_a_project_by_accident_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    make_key(path, "k1", project="team")
    with pytest.raises(ApiKeysError, match="give --project team"):
        make_key(path, "team")
    with pytest.raises(ApiKeysError, match="key of project 'team'"):
        make_key(path, "k2", project="k1")
    with pytest.raises(ApiKeysError, match="has an API key already"):
        make_key(path, "k1")


def test_a_keys_file_without_projects_still_reads(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.write_text(
        '{"keys": [{"name": "old", "sha256": "'
        + "0" * 64
        + '", "created_at": "2026-01-01T00:00:00Z"}]}'
    )
    assert [k.project_name for k in read_keys(path).keys] == ["old"]
    path.write_text('{"keys": [{"name": 3}]}')
    with pytest.raises(KeysFileError):
        read_keys(path)


def test_quota_and_wait_settings_are_checked() -> None:
    got = GatewayConfig.from_env({"LORAFLEET_GATEWAY_MAX_JOBS_IN_FLIGHT_PER_PROJECT": "3"})
    assert got.max_jobs_in_flight_per_project == 3 and got.max_upload_bytes_per_project is None
    with pytest.raises(GatewayConfigError, match="MAX_UPLOAD_BYTES_PER_PROJECT must be >= 1"):
        GatewayConfig.from_env({"LORAFLEET_GATEWAY_MAX_UPLOAD_BYTES_PER_PROJECT": "0"})
    with pytest.raises(GatewayConfigError, match="ADAPTER_LOAD_WAIT_S"):
        GatewayConfig(adapter_load_wait_s=-1)


def api_key(path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The real `lorafleet auth api-key ARGS --file path`."""
    argv = [sys.executable, "-m", "lorafleet_services.cli", "auth", "api-key", *args]
    return subprocess.run([*argv, "--file", str(path)], capture_output=True, text=True, timeout=60)


def test_the_api_key_commands_exit_codes(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    made = api_key(path, "create", "ci", "--project", "team")
    assert made.returncode == Exit.OK and made.stdout.startswith("lf-"), made.stderr
    assert KeyRing(path).caller_of(made.stdout.strip()) == Caller("ci", "team")
    listed = api_key(path, "list")
    assert listed.returncode == Exit.OK and "ci" in listed.stdout and "team" in listed.stdout
    unknown = api_key(path, "revoke", "nobody")
    assert unknown.returncode == Exit.REFUSED and "no API key 'nobody'" in unknown.stderr
    path.write_text("not json")
    broken = api_key(path, "list")
    assert broken.returncode == Exit.BAD_FILE and "not a lorafleet API keys file" in broken.stderr
