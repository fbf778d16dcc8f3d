"""Retention's rule of what is still needed, and the grace, as plain
functions (lorafleet.retention.rules, lorafleet.retention._sweep.due): no bus."""

from __future__ import annotations

import datetime as dt

import msgspec
import pytest

from lorafleet.objects import ListedObject
from lorafleet.retention._sweep import Unneeded, due
from lorafleet.retention.rules import (
    ArtifactRefs,
    DatasetUse,
    Policy,
    artifact_removal,
    dataset_removal,
    job_of_artifact,
    refusal,
)
from lorafleet_schemas.messages import (
    Engine,
    JobState,
    ModelRecord,
    Replicas,
    ServingRecord,
    ServingState,
)
from tests.records import T0, job_record

DAY_S = 86400.0
#: Checkpoints kept 14 days, adapters 30, data 7 after its last job; grace 10 min.
POLICY = Policy(
    grace_s=600, checkpoint_after_s=14 * DAY_S, adapter_after_s=30 * DAY_S,
    dataset_after_s=7 * DAY_S,
)  # fmt: skip
ENDED = T0
MODEL = ModelRecord(
    name="tiny", engine=Engine.VLLM, hf_repo=None, hf_revision="main", local_dir="/m",
    description="", created_at=T0,
)  # fmt: skip


def after(days: float) -> dt.datetime:
    return ENDED + dt.timedelta(days=days)


def done(job_id: str = "job1", **changes: object) -> ArtifactRefs:
    job = job_record(**{"id": job_id, "state": JobState.DONE, "finished_at": ENDED, **changes})
    return ArtifactRefs(jobs={job_id: job}, models={"tiny": MODEL})


def served(state: ServingState) -> ServingRecord:
    return ServingRecord(
        job_id="job1", node="n1", engine="http://e", engine_kind=Engine.VLLM, model="tiny",
        served_name="job1-x", sha256="ab" * 32, state=state, created_at=T0, updated_at=T0,
    )  # fmt: skip


def test_object_names() -> None:
    assert job_of_artifact("job1/checkpoint") == ("job1", "checkpoint")
    assert job_of_artifact("job1/peft") == ("job1", "peft")
    assert job_of_artifact("sha256/abc") is None
    assert job_of_artifact("job1/other") is None


@pytest.mark.parametrize(
    "state", [s for s in JobState if s not in (JobState.DONE, JobState.FAILED, JobState.CANCELLED)]
)
def test_an_active_jobs_artifacts_are_needed_however_old(state: JobState) -> None:
    refs = ArtifactRefs(jobs={"job1": job_record(state=state, updated_at=ENDED)})
    for kind in ("checkpoint", "peft"):
        assert artifact_removal("job1", kind, refs, POLICY, after(365)) is None


def test_a_final_jobs_checkpoint_goes_after_its_age() -> None:
    for state in (JobState.DONE, JobState.FAILED, JobState.CANCELLED):
        refs = done(state=state)
        assert artifact_removal("job1", "checkpoint", refs, POLICY, after(13.9)) is None
        why = artifact_removal("job1", "checkpoint", refs, POLICY, after(15))
        assert why is not None and "ended 15 days ago" in why and "14 days" in why


def test_ages_of_zero_keep_for_ever() -> None:
    never = Policy(checkpoint_after_s=0, adapter_after_s=0, dataset_after_s=0)
    assert artifact_removal("job1", "checkpoint", done(), never, after(3650)) is None
    assert artifact_removal("job1", "peft", done(), never, after(3650)) is None
    uses = {"sha256/a": DatasetUse().add(JobState.DONE, ENDED)}
    assert dataset_removal("sha256/a", {}, uses, never, after(3650)) is None


def test_a_done_jobs_adapter_goes_after_its_age_unless_served_or_placed() -> None:
    assert artifact_removal("job1", "peft", done(), POLICY, after(29)) is None
    assert artifact_removal("job1", "gguf", done(), POLICY, after(31)) is not None
    for state in (ServingState.LOADING, ServingState.SERVED, ServingState.RESTART_REQUIRED):
        refs = ArtifactRefs(jobs=done().jobs, serving=[served(state)])
        assert artifact_removal("job1", "peft", refs, POLICY, after(365)) is None, state
    for state in (ServingState.UNLOADED, ServingState.REFUSED, ServingState.FAILED):
        refs = ArtifactRefs(jobs=done().jobs, serving=[served(state)])
        assert artifact_removal("job1", "peft", refs, POLICY, after(365)) is not None, state
    # A serving policy, the job's own or its model's: the scheduler places it.
    assert artifact_removal("job1", "peft", done(serving="all"), POLICY, after(365)) is None
    model = msgspec.structs.replace(MODEL, serving=Replicas(replicas=2))
    refs = ArtifactRefs(jobs=done().jobs, models={"tiny": model})
    assert artifact_removal("job1", "peft", refs, POLICY, after(365)) is None
    # ... unless the job said serve: false.
    refs = ArtifactRefs(jobs=done(serve=False).jobs, models={"tiny": model})
    assert artifact_removal("job1", "peft", refs, POLICY, after(365)) is not None


def test_what_a_job_starts_from_is_needed() -> None:
    refs = ArtifactRefs(jobs=done().jobs, resumers={"job1": "job2"})
    assert artifact_removal("job1", "checkpoint", refs, POLICY, after(365)) is None
    assert artifact_removal("job1", "peft", refs, POLICY, after(365)) is None


def test_a_deleted_jobs_artifacts_go() -> None:
    why = artifact_removal("gone", "peft", ArtifactRefs(jobs={}), POLICY, ENDED)
    assert why is not None and "not in the recorder" in why


def test_data_named_by_a_file_or_an_active_job_is_needed() -> None:
    active = {"sha256/a": DatasetUse().add(JobState.DONE, ENDED).add(JobState.RUNNING, ENDED)}
    assert dataset_removal("sha256/a", {}, active, POLICY, after(365)) is None
    final = {"sha256/a": DatasetUse().add(JobState.FAILED, ENDED)}
    assert dataset_removal("sha256/a", {"sha256/a": "file-1"}, final, POLICY, after(365)) is None
    assert dataset_removal("sha256/a", {"sha256/a": "file-1"}, {}, POLICY, after(365)) is None


def test_data_of_final_jobs_goes_after_the_newest_ended() -> None:
    uses = {"sha256/a": DatasetUse().add(JobState.DONE, ENDED).add(JobState.FAILED, after(5))}
    assert dataset_removal("sha256/a", {}, uses, POLICY, after(11)) is None
    why = dataset_removal("sha256/a", {}, uses, POLICY, after(13))
    assert why is not None and "ended 8 days ago" in why


def test_data_nothing_names_goes() -> None:
    why = dataset_removal("sha256/a", {"sha256/b": "file-1"}, {}, POLICY, ENDED)
    assert why is not None and "no job and no file" in why
    # Put by hand under a name of its own (for a submit to come): the operator's.
    assert dataset_removal("my-data.jsonl", {}, {}, POLICY, ENDED) is None
    # ... until a job named it and its age passed.
    uses = {"my-data.jsonl": DatasetUse().add(JobState.DONE, ENDED)}
    assert dataset_removal("my-data.jsonl", {}, uses, POLICY, after(8)) is not None


def test_a_database_that_knows_none_of_the_jobs_removes_nothing() -> None:
    assert refusal(3, 0, "datasets") is not None
    assert refusal(3, 1, "datasets") is None
    assert refusal(0, 0, "datasets") is None


def test_the_grace_counts_from_the_first_run_that_found_it_with_that_info() -> None:
    obj = ListedObject("sha256/a", 10, "nuid", seq=5)
    u = [Unneeded(obj, "dataset", "why")]
    ready, waiting, marks = due(u, {}, T0, grace_s=600)
    assert (ready, waiting) == ([], u)
    ready, waiting, marks = due(u, marks, T0 + dt.timedelta(seconds=599), grace_s=600)
    assert ready == []
    ready, _, _ = due(u, marks, T0 + dt.timedelta(seconds=600), grace_s=600)
    assert ready == u
    # Touched since (a new info sequence): the grace starts again.
    touched = [Unneeded(ListedObject("sha256/a", 10, "nuid", seq=9), "dataset", "why")]
    ready, _, marks = due(touched, marks, T0 + dt.timedelta(seconds=601), grace_s=600)
    assert ready == [] and list(marks) == [("sha256/a", 9)]
    # Needed again: its mark goes, so a later unneeded spell starts afresh.
    assert due([], marks, T0, grace_s=600)[2] == {}
    # No grace: at once.
    assert due(u, {}, T0, grace_s=0)[0] == u
