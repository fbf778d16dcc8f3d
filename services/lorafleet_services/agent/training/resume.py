"""Starting a job from a stored checkpoint or adapter (StartRequest.resume).

Before the trainer starts, the agent fetches the object the scheduler named
(`CheckpointRef.object` in the artifacts bucket), checks its size and sha256
against the reference, unpacks it into `<job dir>/resume/`, and names it in
job.json's `resume` ("continue": the job's own checkpoint; "weights":
another job's checkpoint or adapter; lorafleet_trainer.jobfile says what
each restores). Anything wrong fails the job with a message saying what,
not retryable: a retry would meet the same object.
"""

from __future__ import annotations

import asyncio
import tarfile
from pathlib import Path
from typing import Any

from nats.js import JetStreamContext

from lorafleet import objects
from lorafleet.names import Names
from lorafleet_schemas.messages import ArtifactKind, CheckpointRef
from lorafleet_services.agent.transfer.fetch import fetch_object
from lorafleet_services.agent.transfer.packing import unpack


class ResumeFetchError(Exception):
    """The job cannot start from what it was to resume from; the message says why."""


def resume_mode(ref: CheckpointRef, job_id: str) -> str:
    """ "continue" for the job's own checkpoint, else "weights"."""
    if ref.kind is ArtifactKind.CHECKPOINT and ref.job_id == job_id:
        return "continue"
    return "weights"


def describe(ref: CheckpointRef) -> str:
    """What `ref` is, for messages: "the checkpoint at step 40 of job j1"."""
    if ref.kind is ArtifactKind.CHECKPOINT:
        return f"the checkpoint at step {ref.step} of job {ref.job_id} (attempt {ref.attempt})"
    return f"the {ref.kind.value} artifact of job {ref.job_id}"


async def fetch_resume(
    js: JetStreamContext, names: Names, ref: CheckpointRef, job_id: str, job_dir: Path
) -> dict[str, Any]:
    """Fetch, check and unpack `ref` under `job_dir`; answer job.json's `resume` entry."""
    bucket = names.artifacts_bucket
    what = describe(ref)
    archive = job_dir / "resume.tar"
    try:
        size, sha = await fetch_object(js, bucket, ref.object, archive)
    except objects.ObjectNotFoundError:
        raise ResumeFetchError(
            f"{what} is not in the object store {bucket} (object {ref.object}): it was "
            "removed; resume from another checkpoint, or submit the job afresh"
        ) from None
    except Exception as e:
        raise ResumeFetchError(f"fetching {what} ({ref.object}) from {bucket}: {e!r}") from None
    if (size, sha) != (ref.size, ref.sha256):
        raise ResumeFetchError(
            f"{what} in {bucket} ({ref.object}) is {size} bytes with sha256 {sha}, but the "
            f"job resumes from {ref.size} bytes with sha256 {ref.sha256}: it was replaced "
            "or damaged; resume from another checkpoint, or submit the job afresh"
        )
    target = job_dir / "resume"
    try:
        await asyncio.to_thread(unpack, archive, target)
    except (tarfile.TarError, OSError) as e:
        raise ResumeFetchError(f"unpacking {what} ({ref.object}): {e}") from None
    finally:
        archive.unlink(missing_ok=True)
    return {"dir": str(target), "mode": resume_mode(ref, job_id)}
