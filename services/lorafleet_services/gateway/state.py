"""What the gateway keeps of its own: file objects and jobs' OpenAI fields.

In one KV bucket (`names.gateway_bucket`, created by the gateway), so it
survives a gateway restart and any gateway replica sees the same: the
recorder keeps the jobs and the object store the data, but neither has a
filename, a suffix, OpenAI's metadata, or who (which API key) made them.
The dataset object's own metadata could hold a filename, but it is named
by its content's sha256, so two uploads of the same bytes would share one;
and a client identity may not purge it to delete a file.

Keys: `files.<owner>.<file id>` and `jobs.<owner>.<lorafleet job id>`,
`owner` the API key's project (tenancy.py), so a project sees only its own
(another's is "not found") and its listing reads its own prefix's keys
(`_natspy.kv_values`: no consumer).
"""

from __future__ import annotations

import datetime as dt
from typing import Any, TypeVar

import msgspec
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from lorafleet.nats._bus import once_more_on_timeout
from lorafleet.nats._natspy import kv_values
from lorafleet_services.gateway.openai_shapes import Hyperparameters, LorafleetOptions

T = TypeVar("T")

#: Seconds a listing waits for the bucket's entries to arrive.
LIST_TIMEOUT_S = 5.0


class FileRecord(msgspec.Struct, kw_only=True):
    id: str
    filename: str
    bytes: int
    created_at: dt.datetime
    purpose: str
    #: The object in the datasets bucket that holds the content.
    dataset: str
    records: int


class JobFields(msgspec.Struct, kw_only=True):
    """What OpenAI's job has that lorafleet's record does not."""

    #: lorafleet's job id (OpenAI's is `ftjob-<this>`).
    job_id: str
    model: str
    training_file: str
    validation_file: str | None = None
    suffix: str | None = None
    seed: int
    metadata: dict[str, str] | None = None
    hyperparameters: Hyperparameters
    lorafleet: LorafleetOptions | None = None
    #: Paused by `POST .../pause` (lorafleet cancelled it, keeping its
    #: checkpoint); cleared by resume and by cancel.
    paused: bool = False
    created_at: dt.datetime
    #: "supervised" or "dpo"; `beta` is DPO's.
    method: str = "supervised"
    beta: float | None = None
    #: The fine-tuned model the job started from (`ft:...`), when it named one:
    #: `model` is then that model's base.
    parent_model: str | None = None


class GatewayState:
    """The bucket, opened once (`open`), read and written per request."""

    def __init__(self, js: JetStreamContext, bucket: str, kv: KeyValue) -> None:
        self.js = js
        self.bucket = bucket
        self.kv = kv

    @classmethod
    async def open(cls, js: JetStreamContext, bucket: str) -> GatewayState:
        return cls(js, bucket, await js.key_value(bucket))

    async def _get(self, key: str, typ: type[T]) -> T | None:
        try:  # a chat reads its job here: one lost with a NATS member is read again
            entry = await once_more_on_timeout(lambda: self.kv.get(key))
        except nats.js.errors.KeyNotFoundError:
            return None
        return msgspec.json.decode(entry.value or b"", type=typ) if entry.value else None

    async def _list(self, prefix: str, typ: type[T], upto: int | None = None) -> list[T]:
        """The entries under `prefix`; `upto`: only those put at or before that
        revision (the bucket's own order of writes, the same on every replica)."""
        entries = await kv_values(self.js, self.kv, self.bucket, f"{prefix}.*", LIST_TIMEOUT_S)
        return [
            msgspec.json.decode(e.value, type=typ)
            for e in entries
            if upto is None or e.revision <= upto
        ]

    # --- files ---
    async def put_file(self, owner: str, file: FileRecord) -> int:
        """Its entry's revision."""
        return await self.kv.put(f"files.{owner}.{file.id}", msgspec.json.encode(file))

    async def file(self, owner: str, file_id: str) -> FileRecord | None:
        if not _is_token(file_id):
            return None
        return await self._get(f"files.{owner}.{file_id}", FileRecord)

    async def files(self, owner: str, upto: int | None = None) -> list[FileRecord]:
        return await self._list(f"files.{owner}", FileRecord, upto)

    async def delete_file(self, owner: str, file_id: str) -> None:
        await self.kv.delete(f"files.{owner}.{file_id}")

    # --- jobs ---
    async def put_job(self, owner: str, job: JobFields) -> int:
        """Its entry's revision."""
        return await self.kv.put(f"jobs.{owner}.{job.job_id}", msgspec.json.encode(job))

    async def delete_job(self, owner: str, job_id: str) -> None:
        await self.kv.delete(f"jobs.{owner}.{job_id}")

    async def job(self, owner: str, job_id: str) -> JobFields | None:
        if not _is_token(job_id):
            return None
        return await self._get(f"jobs.{owner}.{job_id}", JobFields)

    async def jobs(self, owner: str, upto: int | None = None) -> list[JobFields]:
        return await self._list(f"jobs.{owner}", JobFields, upto)


def _is_token(value: Any) -> bool:
    """An id a KV key can hold (a caller's id may be anything)."""
    return (
        isinstance(value, str)
        and bool(value)
        and all(c.isalnum() or c in "-_" for c in value)
        and len(value) <= 128
    )
