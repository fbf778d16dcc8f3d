"""`POST /v1/files` checks its records while the data is put: a good file
of many pieces is stored whole and named by its sha256; a refused one, bad
far into the data (after chunks of it were put), leaves no object, no
chunk and no file entry."""

from __future__ import annotations

import asyncio
import hashlib

import httpx2
import openai
import psutil
import pytest
from bench.nemesis_gateway import listed
from nats.js.errors import ObjectNotFoundError

from lorafleet.names import dataset_object_name, object_chunk_subjects, object_stream
from lorafleet.objects import STAGED_CHUNK_BYTES
from lorafleet_services.gateway.uploads import CHECK_PIECE_BYTES
from tests.gateway.conftest import Gateway

pytestmark = pytest.mark.asyncio(loop_scope="module")

LINE = b'{"q": "what is the capital of France?", "a": "Paris."}\n'
#: Seconds a killed worker has to be gone.
WORKER_EXIT_TIMEOUT_S = 10.0
#: Lines enough for several check pieces and object chunks.
MANY = 3 * max(CHECK_PIECE_BYTES, STAGED_CHUNK_BYTES) // len(LINE)


async def chunks_held(gateway: Gateway) -> int:
    """Messages on the datasets bucket's chunk subjects (all objects')."""
    bucket = gateway.stack.settings.names.datasets_bucket
    info = await gateway.stack.js.stream_info(
        object_stream(bucket), subjects_filter=object_chunk_subjects(bucket)
    )
    return sum((info.state.subjects or {}).values())


async def test_a_file_of_many_pieces_is_stored_whole(gateway: Gateway) -> None:
    data = LINE * MANY + b'{"q": "last", "a": "line"}'  # no newline at the end
    async with gateway.sdk() as sdk:
        uploaded = await sdk.files.create(file=("big.jsonl", data), purpose="fine-tune")
        assert uploaded.bytes == len(data) and uploaded.filename == "big.jsonl"
        assert (await sdk.files.content(uploaded.id)).content == data
        before = await chunks_held(gateway)
        again = await sdk.files.create(file=("again.jsonl", data), purpose="fine-tune")
        # The same bytes: one object, and no second copy of its chunks kept.
        assert await chunks_held(gateway) == before
        assert (await sdk.files.content(again.id)).content == data
    store = await gateway.stack.js.object_store(gateway.stack.settings.names.datasets_bucket)
    info = await store.get_info(dataset_object_name(hashlib.sha256(data).hexdigest()))
    assert info.size == len(data)


async def test_a_refused_file_leaves_no_object_no_chunk_and_no_entry(gateway: Gateway) -> None:
    bad_line = MANY + 1
    data = LINE * MANY + b'{"q": "no answer"}\n' + LINE * 10
    store = await gateway.stack.js.object_store(gateway.stack.settings.names.datasets_bucket)
    async with gateway.sdk() as sdk:
        files_before = [f.id async for f in sdk.files.list()]
        chunks_before = await chunks_held(gateway)
        with pytest.raises(openai.BadRequestError) as caught:
            await sdk.files.create(file=("bad.jsonl", data), purpose="fine-tune")
        assert f'line {bad_line}: the record has no "a"' in caught.value.message
        assert caught.value.param == "file"
        assert [f.id async for f in sdk.files.list()] == files_before
    assert await chunks_held(gateway) == chunks_before
    with pytest.raises(ObjectNotFoundError):
        await store.get_info(dataset_object_name(hashlib.sha256(data).hexdigest()))


async def test_a_good_file_with_a_wrong_purpose_is_not_kept(gateway: Gateway) -> None:
    data = LINE * MANY
    async with gateway.sdk() as sdk:
        chunks_before = await chunks_held(gateway)
        with pytest.raises(openai.BadRequestError) as caught:
            await sdk.files.create(file=("a.jsonl", data), purpose="assistants")
        assert caught.value.param == "purpose"
    assert await chunks_held(gateway) == chunks_before


async def test_an_upload_after_a_check_worker_died_is_checked_by_a_new_one(
    gateway: Gateway,
) -> None:
    """A pool with a dead worker refuses every later task: without a new
    pool every upload would fail until the gateway restarts."""
    gateway_process = psutil.Process(gateway.proc.pid)
    workers = [
        p for p in gateway_process.children()
        if any("multiprocessing.spawn" in part or "spawn_main" in part for part in p.cmdline())
        and "resource_tracker" not in " ".join(p.cmdline())
    ]  # fmt: skip
    assert workers, [p.cmdline() for p in gateway_process.children()]
    workers[0].kill()
    workers[0].wait(WORKER_EXIT_TIMEOUT_S)
    await asyncio.sleep(0.5)  # the pool's manager thread sees the death and marks it broken
    data = LINE * 50
    async with gateway.sdk() as sdk:
        uploaded = await sdk.files.create(file=("after.jsonl", data), purpose="fine-tune")
        assert uploaded.bytes == len(data)
        bad = b'{"q": "no answer"}\n'
        with pytest.raises(openai.BadRequestError):  # still checked, by the new workers
            await sdk.files.create(file=("bad.jsonl", bad), purpose="fine-tune")


async def test_the_nemesis_reads_every_page_of_a_listing(gateway: Gateway) -> None:
    """bench/nemesis_gateway.listed, the nemesis's read of a key's files: an
    hour's run uploads past the gateway's 100 a page, and the first page
    alone judged every later upload lost (seed 44)."""
    async with gateway.sdk() as sdk:
        made = [
            (await sdk.files.create(file=(f"page-{i}.jsonl", LINE), purpose="fine-tune")).id
            for i in range(5)
        ]
        every = [f.id async for f in sdk.files.list()]
    assert set(made) <= set(every)
    auth = {"authorization": f"Bearer {gateway.keys['alice']}"}
    async with httpx2.AsyncClient() as http:
        got = await listed(http, gateway.url, "/v1/files", auth, page_items=2)
    assert [f["id"] for f in got] == every
