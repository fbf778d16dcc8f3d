"""`POST /v1/files`: the multipart body read as it arrives, its file checked
and stored at once.

The file's bytes go to the datasets bucket chunk by chunk as they come
(`objects.StagedObject`: under a subject no object names yet), and pieces of
whole lines go to the record check (`training_data.check_lines`, the
recorder's rules) in a worker process, which runs beside the put instead
of before it (bench/gateway.py: the check alone takes longer than the
put). The object is named and made visible only when the body has ended
and every piece passed; a refused upload, or one whose client went away,
has its chunks purged and leaves no object and no file entry.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import ParamSpec, TypeVar

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header

from lorafleet.names import dataset_object_name
from lorafleet.objects import StagedObject
from lorafleet.training_data import DataError, LineSplitter, check_lines
from lorafleet_services.gateway.http_errors import GatewayHttpError, bad_request

#: Bytes of file data gathered into one piece for the check: a piece costs
#: a hop to the worker process, so fewer, larger ones (uvicorn hands the
#: body over in 64 KiB pieces).
CHECK_PIECE_BYTES = 1 << 20
#: Most bytes of the form's other fields (`purpose`) taken.
MAX_FIELD_BYTES = 4096
#: The multipart field that holds the file, and the one naming its purpose.
FILE_FIELD, PURPOSE_FIELD = "file", "purpose"
#: The only purpose lorafleet keeps files for.
FINE_TUNE = "fine-tune"

P = ParamSpec("P")
R = TypeVar("R")


class CheckWorkers(Executor):
    """The processes that check uploads' records: a process pool started anew
    when one of its workers died. A pool with a dead worker refuses every
    later task (BrokenProcessPool), which would fail every upload until the
    gateway restarts; the upload that was in flight is a 503 to send again.
    Spawned, not forked, from a process with threads and sockets."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._pool = self._started()

    def _started(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(self.workers, multiprocessing.get_context("spawn"))

    def submit(self, fn: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> Future[R]:
        try:
            return self._pool.submit(fn, *args, **kwargs)
        except BrokenProcessPool:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = self._started()
            return self._pool.submit(fn, *args, **kwargs)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._pool.shutdown(wait=wait, cancel_futures=cancel_futures)


@dataclass
class StoredFile:
    """An upload that passed: its dataset object, and what the file entry says."""

    filename: str
    purpose: str
    size: int
    records: int
    dataset: str


@dataclass
class _Part:
    name: str = ""
    filename: str | None = None
    value: bytearray = field(default_factory=bytearray)


class _Form:
    """python-multipart's parser, its callbacks turned into what a feed brings:
    the file part's bytes (returned), the other fields' (kept, small)."""

    def __init__(self, content_type: str) -> None:
        kind, options = parse_options_header(content_type)
        boundary = options.get(b"boundary")
        if kind != b"multipart/form-data" or not boundary:
            raise bad_request(
                f"Content-Type {content_type!r}: send multipart/form-data with the fields "
                f"`{FILE_FIELD}` (the JSONL) and `{PURPOSE_FIELD}`",
                FILE_FIELD,
            )
        self.fields: dict[str, bytearray] = {}
        self.filename: str | None = None
        self._part = _Part()
        self._header = (bytearray(), bytearray())
        self._disposition = b""
        self._file_data: list[bytes] = []
        self._parser = MultipartParser(
            boundary,
            {
                "on_part_begin": self._begin,
                "on_part_data": self._data,
                "on_header_field": lambda d, s, e: self._header[0].extend(d[s:e]),
                "on_header_value": lambda d, s, e: self._header[1].extend(d[s:e]),
                "on_header_end": self._header_end,
                "on_headers_finished": self._headers_done,
            },
        )

    def feed(self, body: bytes) -> list[bytes]:
        """The file's bytes among `body`'s (the next of the request's)."""
        try:
            self._parser.write(body)
        except FormParserError as e:
            raise bad_request(f"the multipart body is malformed: {e}", FILE_FIELD) from None
        data, self._file_data = self._file_data, []
        return data

    def _begin(self) -> None:
        self._part, self._disposition = _Part(), b""

    def _header_end(self) -> None:
        name, value = self._header
        if bytes(name).lower() == b"content-disposition":
            self._disposition = bytes(value)
        self._header = (bytearray(), bytearray())

    def _headers_done(self) -> None:
        _, options = parse_options_header(self._disposition)
        self._part.name = options.get(b"name", b"").decode(errors="replace")
        filename = options.get(b"filename")
        if self._part.name == FILE_FIELD and filename is not None and self.filename is None:
            self._part.filename = self.filename = filename.decode(errors="replace")

    def _data(self, data: bytes, start: int, end: int) -> None:
        if self._part.filename is not None:
            self._file_data.append(data[start:end])
            return
        value = self.fields.setdefault(self._part.name, bytearray())
        if len(value) + end - start > MAX_FIELD_BYTES:
            raise bad_request(f"the field {self._part.name!r} is over {MAX_FIELD_BYTES} bytes")
        value.extend(data[start:end])


class _Checks:
    """The pieces of the file sent to the check as they are cut."""

    def __init__(self, checker: Executor) -> None:
        self.checker = checker
        self.splitter = LineSplitter()
        self._gathered: list[bytes] = []
        self._gathered_bytes = 0
        self._running: list[asyncio.Future[int]] = []

    def add(self, data: bytes) -> None:
        self._gathered.append(data)
        self._gathered_bytes += len(data)
        if self._gathered_bytes >= CHECK_PIECE_BYTES:
            self._send(self.splitter.take(b"".join(self._gathered)))
            self._gathered, self._gathered_bytes = [], 0

    def failed(self) -> bool:
        """Whether a piece already checked was refused (the rest need not be)."""
        return any(f.done() and f.exception() is not None for f in self._running)

    async def records(self) -> int:
        """The records of the whole file; DataError for the first bad line."""
        self._send(self.splitter.take(b"".join(self._gathered)))
        self._send(self.splitter.end())
        counts = await asyncio.gather(*self._running, return_exceptions=True)
        errors = sorted((e for e in counts if isinstance(e, DataError)), key=lambda e: e.line)
        if errors:
            raise errors[0]
        for outcome in counts:
            if isinstance(outcome, BrokenProcessPool):
                raise GatewayHttpError(
                    503, "the upload's record check stopped (a worker process died): "
                    "send the file again", code="unavailable",
                ) from outcome  # fmt: skip
            if isinstance(outcome, BaseException):
                raise outcome
        return sum(c for c in counts if isinstance(c, int))

    def _send(self, piece: tuple[bytes, int] | None) -> None:
        if piece is not None:
            loop = asyncio.get_running_loop()
            self._running.append(loop.run_in_executor(self.checker, check_lines, *piece))


async def store_upload(
    body: AsyncIterator[bytes], content_type: str, staged: StagedObject, checker: Executor
) -> StoredFile:
    """Read the multipart `body`, write its file into `staged` and check it
    with `checker`; commit the object once all of it passed. Raises the
    400 that says what to change (`staged`'s context then discards it)."""
    form, checks = _Form(content_type), _Checks(checker)
    async for received in body:
        for data in form.feed(received):
            if checks.failed():
                continue  # refused already: the rest is read, not kept
            checks.add(data)
            await staged.write(data)
    purpose = form.fields.get(PURPOSE_FIELD, bytearray()).decode(errors="replace")
    if purpose != FINE_TUNE:
        raise bad_request(
            f"purpose {purpose!r}: lorafleet keeps files for fine-tuning only; "
            f'give purpose="{FINE_TUNE}"',
            PURPOSE_FIELD,
        )
    if form.filename is None:
        raise bad_request(
            f"no file: send the JSONL as the multipart field `{FILE_FIELD}`", FILE_FIELD
        )
    try:
        records = await checks.records()
    except DataError as e:
        raise bad_request(f"{form.filename or 'the file'}: {e}", FILE_FIELD) from None
    dataset = dataset_object_name(staged.sha256())
    await staged.commit(dataset)
    return StoredFile(form.filename or "data.jsonl", purpose, staged.size, records, dataset)
