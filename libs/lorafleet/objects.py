"""Reading a NATS object-store object with one JetStream API call only.

nats-py's `ObjectStore.get` looks the stream up by subject
(`$JS.API.STREAM.NAMES`, which lists every stream's name), asks for its
info, and creates a push consumer whose deliver subject the caller picks.
A node's credentials would have to allow all three. `read_object` reads the
object's meta message and then each chunk with `$JS.API.STREAM.MSG.GET` on
`OBJ_<bucket>`, so that one subject on that one stream is all a reader
needs. It costs one request per chunk (128 KiB by default).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
from typing import BinaryIO

import nats.js.errors
from nats.js import JetStreamContext

from lorafleet.artifacts import decode_info

#: JetStream's digest field prefix for sha256.
_DIGEST_PREFIX = "SHA-256="


class ObjectNotFoundError(LookupError):
    """No such object (or it was deleted) in the bucket."""


class ObjectDamagedError(ValueError):
    """The object's chunks are not what its meta message says (size, digest)."""


def object_stream(bucket: str) -> str:
    """The stream behind an object-store bucket."""
    return f"OBJ_{bucket}"


def meta_subject(bucket: str, name: str) -> str:
    return f"$O.{bucket}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"


def chunk_subject(bucket: str, nuid: str) -> str:
    return f"$O.{bucket}.C.{nuid}"


def msg_get_subject(bucket: str) -> str:
    """The one JetStream API subject `read_object` requests (for permissions)."""
    return f"$JS.API.STREAM.MSG.GET.{object_stream(bucket)}"


async def read_object(js: JetStreamContext, bucket: str, name: str, out: BinaryIO) -> int:
    """Write object `name` of `bucket` into `out`; return its size in bytes.

    Checks the size and the sha256 the object's meta message records.
    Raises ObjectNotFoundError, ObjectDamagedError, or nats' errors (a
    timeout when the server does not answer, or refuses the request).
    """
    stream = object_stream(bucket)
    try:
        meta = await js.get_last_msg(stream, meta_subject(bucket, name))
    except nats.js.errors.NotFoundError:
        raise ObjectNotFoundError(f"no object {name!r} in bucket {bucket}") from None
    info = decode_info(meta.data or b"")
    if info is None or info.deleted or not info.nuid:
        raise ObjectNotFoundError(f"no object {name!r} in bucket {bucket} (deleted)")
    subject = chunk_subject(bucket, info.nuid)
    h = hashlib.sha256()
    size = 0
    seq = 1
    for _ in range(info.chunks):
        try:
            msg = await js.get_msg(stream, seq=seq, subject=subject, next=True)
        except nats.js.errors.NotFoundError:
            break
        data = msg.data or b""
        await asyncio.to_thread(out.write, data)
        h.update(data)
        size += len(data)
        seq = (msg.seq or seq) + 1
    if size != info.size:
        raise ObjectDamagedError(
            f"object {name!r} in {bucket}: read {size} bytes, its meta says {info.size}"
        )
    want = info.digest.removeprefix(_DIGEST_PREFIX).removeprefix(_DIGEST_PREFIX.lower())
    if want and base64.urlsafe_b64decode(want) != h.digest():
        raise ObjectDamagedError(f"object {name!r} in {bucket}: sha256 differs from its meta")
    return size
