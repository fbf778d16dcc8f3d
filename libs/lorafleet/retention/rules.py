"""What is still needed, as plain functions over plain data (no bus, no clock).

The one rule, per kind of stored object. An artifact (`<job>/<kind>` in the
artifacts bucket) is needed while

- its job is not final (queued, starting, preparing, running, converting,
  uploading): a requeue or a resume continues from its checkpoint;
- a job that is not final starts from it (`resume_from`);
- it is an adapter (peft, gguf) of a done job that is served or about to be
  (a serving record loading, served, or restart_required) or that has a
  serving policy (its own or its model's: the scheduler places it);
- its job ended less than the kind's age ago (`checkpoint_after_s`,
  `adapter_after_s`; 0: for ever).

A job the recorder does not know (deleted) needs nothing.

A dataset (an object in the datasets bucket) is needed while a gateway file
names it, a job that is not final names it (as its data or evaluation set),
or a final job names it and `dataset_after_s` is 0 or has not passed since
the newest such job ended. One that nothing names is needed only when its
name is not lorafleet's (`sha256/<hex>`, what uploads and inline data are
stored as): an operator put it by hand (`nats object put`) for a submit to
come.

Removal is by the sweep (`_sweep.py`), which takes an unneeded object only
once it has been found unneeded for `grace_s` (sweeps that far apart): the
references are read one after the other, not at one instant, and a
reference may be on its way (a job being submitted for a file being deleted).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from lorafleet.fleet_serving import policy_of
from lorafleet.names import dataset_object_name
from lorafleet.settings import Settings
from lorafleet.states import FINAL
from lorafleet_schemas.messages import (
    ArtifactKind,
    JobRecord,
    JobState,
    ModelRecord,
    ServingRecord,
    ServingState,
)

#: Serving states in which a node holds the adapter, or is about to (a
#: llama.cpp engine in restart_required has its GGUF in place and reads it
#: at its next start): the object is what a node that joins loads.
SERVING_NEEDS = frozenset(
    {ServingState.LOADING, ServingState.SERVED, ServingState.RESTART_REQUIRED}
)

#: The kind of a dataset object in reports.
DATASET = "dataset"


@dataclass(frozen=True)
class Policy:
    """The retention settings (Settings.retention_*), in seconds; 0 is off."""

    grace_s: float = 600.0
    checkpoint_after_s: float = 1_209_600.0
    adapter_after_s: float = 0.0
    dataset_after_s: float = 0.0

    @classmethod
    def of(cls, settings: Settings) -> Policy:
        return cls(
            grace_s=settings.retention_grace_s,
            checkpoint_after_s=settings.retention_checkpoint_after_s,
            adapter_after_s=settings.retention_adapter_after_s,
            dataset_after_s=settings.retention_dataset_after_s,
        )


@dataclass(frozen=True)
class StoredObject:
    """An object as its bucket's info message describes it."""

    name: str
    size: int
    #: When its info was written (the commit).
    stored_at: dt.datetime


def job_of_artifact(name: str) -> tuple[str, str] | None:
    """(job, kind) of an artifact object `<job>/<kind>`; None for any other name."""
    job, sep, kind = name.partition("/")
    if not sep or not job or kind not in {k.value for k in ArtifactKind}:
        return None
    return job, kind


def ended_at(job: JobRecord) -> dt.datetime:
    """When a final job ended (its last change, for one that has no finish time)."""
    return job.finished_at or job.updated_at


def duration(seconds: float) -> str:
    """Seconds in words: `14 days`, `5 hours`, `90 s`."""
    s = max(0.0, seconds)
    if s >= 2 * 86400:
        return f"{s / 86400:.0f} days"
    if s >= 2 * 3600:
        return f"{s / 3600:.0f} hours"
    return f"{s:.0f} s"


def _age(now: dt.datetime, then: dt.datetime) -> str:
    return duration((now - then).total_seconds())


@dataclass(frozen=True)
class ArtifactRefs:
    """What the artifact rule reads: the recorder's view, taken by the sweep.

    jobs: the owners of the stored artifacts that the recorder knows (a
    missing one was deleted). resumers: job -> a job not final that starts
    from it. serving: the serving records of those jobs. models: the
    catalog (a model's default serving policy).
    """

    jobs: Mapping[str, JobRecord]
    resumers: Mapping[str, str] = field(default_factory=dict)
    serving: Iterable[ServingRecord] = ()
    models: Mapping[str, ModelRecord] = field(default_factory=dict)


def artifact_removal(
    job_id: str, kind: str, refs: ArtifactRefs, policy: Policy, now: dt.datetime
) -> str | None:
    """Why the artifact `kind` of `job_id` may go, or None while it is needed."""
    job = refs.jobs.get(job_id)
    if job is None:
        return f"job {job_id} is not in the recorder (deleted)"
    if job.state not in FINAL:
        return None
    if job_id in refs.resumers:
        return None
    after_s = policy.checkpoint_after_s
    if kind != ArtifactKind.CHECKPOINT.value:
        if job.state is JobState.DONE:
            served = [r for r in refs.serving if r.job_id == job_id and r.state in SERVING_NEEDS]
            if served or policy_of(job, refs.models.get(job.model)) is not None:
                return None
        after_s = policy.adapter_after_s
    if after_s <= 0:
        return None
    end = ended_at(job)
    if (now - end).total_seconds() < after_s:
        return None
    what = "checkpoints" if kind == ArtifactKind.CHECKPOINT.value else "adapters not served"
    return (
        f"job {job_id} ({job.state.value}) ended {_age(now, end)} ago; {what} are kept "
        f"{duration(after_s)} after their job ends"
    )


@dataclass(frozen=True)
class DatasetUse:
    """The jobs that name one dataset: whether any is not final, and when the
    newest final one ended."""

    active: bool = False
    newest_end: dt.datetime | None = None

    def add(self, state: JobState, end: dt.datetime) -> DatasetUse:
        if state not in FINAL:
            return DatasetUse(active=True, newest_end=self.newest_end)
        newest = end if self.newest_end is None else max(self.newest_end, end)
        return DatasetUse(active=self.active, newest_end=newest)


def dataset_removal(
    name: str,
    files: Mapping[str, str],
    uses: Mapping[str, DatasetUse],
    policy: Policy,
    now: dt.datetime,
) -> str | None:
    """Why the dataset `name` may go, or None while it is needed.

    files: dataset -> a gateway file that names it. uses: dataset -> the
    jobs that name it.
    """
    if name in files:
        return None
    use = uses.get(name)
    if use is None:
        if not name.startswith(dataset_object_name("")):
            return None  # put by hand under a name of its own, for a submit to come
        return "no job and no file names it (its files were deleted, or it was never used)"
    if use.active or use.newest_end is None or policy.dataset_after_s <= 0:
        return None
    if (now - use.newest_end).total_seconds() < policy.dataset_after_s:
        return None
    return (
        f"only final jobs name it, the newest ended {_age(now, use.newest_end)} ago; data is "
        f"kept {duration(policy.dataset_after_s)} after its last job ends"
    )


def refusal(stored: int, known: int, what: str) -> str | None:
    """Why a sweep should remove nothing at all: objects are stored but the
    recorder knows none of their jobs (a fresh or wrong database would
    otherwise read as every job deleted)."""
    if stored and not known:
        return (
            f"{stored} {what} are stored but the recorder knows none of their jobs: a fresh "
            "or wrong database (LORAFLEET_DATABASE_URL)? nothing was removed"
        )
    return None
