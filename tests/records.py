"""Wire records built for tests: one JobRecord with every field set, changed
per test with keyword arguments (msgspec.structs.replace)."""

from __future__ import annotations

import datetime as dt

import msgspec

from lorafleet_schemas.messages import ArtifactKind, Engine, JobRecord, JobState, TrainerParams

#: The time every record built here was created and updated at.
T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def job_record(**changes: object) -> JobRecord:
    """Job `job1` of model `tiny` (vLLM), queued, no node, 1000 MiB, attempt 1."""
    base = JobRecord(
        id="job1",
        name="",
        model="tiny",
        engine=Engine.VLLM,
        node=None,
        gpu_memory_mib=1000,
        dataset="sha256/x",
        dataset_sha256="0" * 64,
        records=10,
        params=TrainerParams(),
        state=JobState.QUEUED,
        message="",
        step=0,
        steps=0,
        loss=None,
        eval_loss=None,
        peak_mib=0,
        attempt=1,
        artifacts_expected=[ArtifactKind.PEFT],
        artifacts_stored=[],
        created_at=T0,
        updated_at=T0,
    )
    return msgspec.structs.replace(base, **changes)
