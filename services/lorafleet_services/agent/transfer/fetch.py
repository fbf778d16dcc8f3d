"""Objects fetched onto the node: the job's dataset (and evaluation set), and
what it resumes from.

A node may read the datasets and the artifacts buckets by message and
direct gets only (`lorafleet.objects.read_object`; lorafleet.access.permissions allows
nothing else there), so this is the one way the agent reads an object.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from nats.js import JetStreamContext

from lorafleet import objects
from lorafleet.nats._bus import when_cluster_answers
from lorafleet_schemas.messages import StartRequest

#: In the job directory: the training data, and the evaluation set beside it.
DATA_FILE, EVAL_DATA_FILE = "data.jsonl", "eval.jsonl"


class DatasetFetchError(Exception):
    """A job's data could not be fetched, or is not what the job says; the
    message is what the job's `failed` report says."""


async def fetch_object(js: JetStreamContext, bucket: str, name: str, path: Path) -> tuple[int, str]:
    """Write object `name` of `bucket` into `path`; answer the (size, sha256)
    of the file written, for the caller to compare with what it expects.

    Raises objects.ObjectNotFoundError when there is no such object,
    objects.ObjectDamagedError when its chunks disagree with its info, and
    nats' errors when the server does not answer (or refuses).
    """
    f = await asyncio.to_thread(path.open, "wb")
    try:
        # Not nats-py's get: read_object needs two API subjects on one
        # stream, what a node's credentials allow (lorafleet.access.permissions).
        # The sha256 of the bytes as written: a second pass over the file
        # cost as much CPU as the reading.
        return await objects.read_object_sha256(js, bucket, name, f)
    finally:
        await asyncio.to_thread(f.close)


async def fetch_checked(
    js: JetStreamContext,
    bucket: str,
    name: str,
    sha256: str,
    path: Path,
    what: str,
    error: type[Exception],
    *,
    gone: str,
    damaged: str,
) -> None:
    """`fetch_object` into `path`, checked against `sha256`; else `error`
    naming `what`: not there (`gone`: what to do), not fetched, or another
    sha256 (`damaged`: what to do). A read the cluster does not answer (a
    member restarting, a stream between leaders) is tried again for
    CLUSTER_WAIT_S, from the start: a rolling restart of the NATS members
    failed a job at "fetching the dataset" (tests/deploy)."""
    try:
        _size, sha = await when_cluster_answers(
            f"fetching the {what} {name!r}", lambda: fetch_object(js, bucket, name, path)
        )
    except objects.ObjectNotFoundError:
        raise error(f"the {what} {name!r} is not in the object store {bucket}: {gone}") from None
    except Exception as e:
        raise error(f"fetching the {what} {name!r} from {bucket}: {e!r}") from None
    if sha != sha256:
        raise error(f"the {what} {name!r} in {bucket} has sha256 {sha}, {damaged}")


async def fetch_datasets(
    js: JetStreamContext, bucket: str, req: StartRequest, job_dir: Path
) -> None:
    """The job's dataset into job_dir/DATA_FILE and its evaluation set, if it
    has one, into job_dir/EVAL_DATA_FILE, each checked against the sha256
    the job holds (what the recorder validated)."""
    sets = [(req.dataset, req.dataset_sha256, DATA_FILE, "dataset")]
    if req.eval_dataset is not None and req.eval_dataset_sha256 is not None:
        sets.append((req.eval_dataset, req.eval_dataset_sha256, EVAL_DATA_FILE, "evaluation set"))
    for name, want_sha256, file, what in sets:
        await fetch_checked(
            js, bucket, name, want_sha256, job_dir / file, what, DatasetFetchError,
            gone="submit the job's data again",
            damaged=f"but the job says {want_sha256}: it was replaced or damaged; "
            "submit the data again",
        )  # fmt: skip
