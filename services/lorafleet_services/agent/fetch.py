"""Objects fetched onto the node: the job's dataset, and what it resumes from.

A node may read the datasets and the artifacts buckets by message gets
only (`lorafleet.objects.read_object`; lorafleet.permissions allows
nothing else there), so this is the one way the agent reads an object.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from nats.js import JetStreamContext

from lorafleet import objects
from lorafleet.artifacts import file_sha256


async def fetch_object(js: JetStreamContext, bucket: str, name: str, path: Path) -> tuple[int, str]:
    """Write object `name` of `bucket` into `path`; answer the (size, sha256)
    of the file written, for the caller to compare with what it expects.

    Raises objects.ObjectNotFoundError when there is no such object,
    objects.ObjectDamagedError when its chunks disagree with its info, and
    nats' errors when the server does not answer (or refuses).
    """
    f = await asyncio.to_thread(path.open, "wb")
    try:
        # Not nats-py's get: read_object needs one API subject on one
        # stream, what a node's credentials allow (lorafleet.permissions).
        await objects.read_object(js, bucket, name, f)
    finally:
        await asyncio.to_thread(f.close)
    sha = await asyncio.to_thread(file_sha256, path)
    return path.stat().st_size, sha
