"""deliver() and pack_adapter() against a real nats-server."""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import random
import tarfile
from pathlib import Path
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client
from nats.js.api import ConsumerConfig, DeliverPolicy, StreamConfig

from lorafleet.artifacts import AsyncPublisher
from lorafleet.names import Header, Names
from lorafleet.nats.server import NatsServer
from lorafleet_schemas.messages import ArtifactChunkHeader, ArtifactKind
from lorafleet_services.agent.transfer import delivery
from lorafleet_services.agent.transfer.delivery import (
    DeliveryError,
    chunk_size_for,
    deliver,
)
from lorafleet_services.agent.transfer.packing import pack_adapter
from tests.eventually import eventually

NAMES = Names()


async def read_stream(
    nc: Client, subject: str
) -> list[tuple[ArtifactChunkHeader, dict[str, str], bytes]]:
    js = nc.jetstream()
    info = await js.stream_info(NAMES.artifacts_stream)
    sub = await js.pull_subscribe(
        subject,
        stream=NAMES.artifacts_stream,
        config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL),
    )
    out: list[tuple[ArtifactChunkHeader, dict[str, str], bytes]] = []
    try:
        while len(out) < info.state.messages:
            for m in await sub.fetch(64, timeout=2):
                await m.ack()
                hdrs = dict(m.headers or {})
                h = msgspec.json.decode(hdrs[Header.CHUNK], type=ArtifactChunkHeader)
                out.append((h, hdrs, m.data))
    except TimeoutError:
        pass
    await sub.unsubscribe()
    return out


async def test_deliver_chunks_with_ids_and_a_last_header(nc: Client, tmp_path: Path) -> None:
    data = random.Random(7).randbytes(3 * 100_000 + 123)
    path = tmp_path / "a.gguf"
    path.write_bytes(data)
    size, sha = await deliver(
        nc.jetstream(),
        NAMES,
        node="n1",
        job_id="j1",
        attempt=2,
        kind=ArtifactKind.GGUF,
        path=path,
        chunk_bytes=100_000,
    )
    assert (size, sha) == (len(data), hashlib.sha256(data).hexdigest())
    chunks = await read_stream(nc, NAMES.artifact_chunks("n1", "j1", "gguf"))
    assert [h.seq for h, _, _ in chunks] == [0, 1, 2, 3]
    assert b"".join(body for _, _, body in chunks) == data
    assert [len(body) for _, _, body in chunks] == [100_000, 100_000, 100_000, 123]
    assert [hd[Header.MSG_ID] for _, hd, _ in chunks] == [f"j1.gguf.2.{i}" for i in range(4)]
    assert not any(h.last for h, _, _ in chunks[:-1])
    last = chunks[-1][0]
    assert (last.last, last.count, last.size, last.sha256) == (True, 4, len(data), sha)
    assert {(h.job_id, h.node, h.kind, h.attempt) for h, _, _ in chunks} == {
        ("j1", "n1", ArtifactKind.GGUF, 2)
    }


async def test_delivering_again_is_deduplicated(nc: Client, tmp_path: Path) -> None:
    path = tmp_path / "a.bin"
    path.write_bytes(os.urandom(250_000))
    js = nc.jetstream()
    for _ in range(2):
        await deliver(
            js,
            NAMES,
            node="n1",
            job_id="j2",
            attempt=1,
            kind=ArtifactKind.PEFT,
            path=path,
            chunk_bytes=100_000,
        )
    info = await js.stream_info(NAMES.artifacts_stream)
    assert info.state.messages == 3


async def test_zero_byte_artifact_is_one_empty_last_chunk(nc: Client, tmp_path: Path) -> None:
    path = tmp_path / "empty"
    path.write_bytes(b"")
    size, sha = await deliver(
        nc.jetstream(), NAMES, node="n1", job_id="j3", attempt=1, kind=ArtifactKind.PEFT, path=path
    )
    chunks = await read_stream(nc, NAMES.artifact_chunks("n1", "j3", "peft"))
    assert len(chunks) == 1
    h, _, body = chunks[0]
    assert body == b""
    assert (h.seq, h.last, h.count, h.size, h.sha256) == (
        0,
        True,
        1,
        0,
        hashlib.sha256(b"").hexdigest(),
    )
    assert (size, sha) == (0, hashlib.sha256(b"").hexdigest())


def test_chunk_size_stays_well_below_max_payload() -> None:
    mib = 1024 * 1024
    assert chunk_size_for(512 * 1024, mib) == 512 * 1024
    assert chunk_size_for(mib, mib) == mib - mib // 8
    assert chunk_size_for(8 * mib, 8 * mib) < 8 * mib
    assert chunk_size_for(64 * 1024, 64 * 1024) == 64 * 1024 - 16 * 1024


async def test_chunk_bytes_at_max_payload_still_delivers(nc: Client, tmp_path: Path) -> None:
    path = tmp_path / "big"
    data = os.urandom(nc.max_payload * 2 + 5)
    path.write_bytes(data)
    size, _ = await deliver(
        nc.jetstream(),
        NAMES,
        node="n1",
        job_id="j4",
        attempt=1,
        kind=ArtifactKind.GGUF,
        path=path,
        chunk_bytes=nc.max_payload,
    )
    assert size == len(data)
    assert nc.is_connected
    chunks = await read_stream(nc, NAMES.artifact_chunks("n1", "j4", "gguf"))
    assert max(len(b) for _, _, b in chunks) < nc.max_payload
    assert b"".join(b for _, _, b in chunks) == data


async def test_a_full_stream_refuses_with_a_clear_error(nc: Client, tmp_path: Path) -> None:
    js = nc.jetstream()
    info = await js.stream_info(NAMES.artifacts_stream)
    cfg: StreamConfig = info.config
    cfg.max_bytes = 300_000
    await js.update_stream(cfg)
    path = tmp_path / "big"
    path.write_bytes(os.urandom(1_000_000))
    with pytest.raises(
        DeliveryError, match=r"refused chunk \d+ of the gguf artifact of job j5: the stream is full"
    ):
        await deliver(
            js,
            NAMES,
            node="n1",
            job_id="j5",
            attempt=1,
            kind=ArtifactKind.GGUF,
            path=path,
            chunk_bytes=100_000,
        )


def test_pack_adapter_is_deterministic(tmp_path: Path) -> None:
    def make(root: Path, mtime: int) -> Path:
        (root / "sub").mkdir(parents=True)
        (root / "adapter_config.json").write_text('{"r": 8}')
        (root / "adapter_model.safetensors").write_bytes(b"\x00" * 1000)
        (root / "sub" / "README.md").write_text("hi")
        for p in root.rglob("*"):
            os.utime(p, (mtime, mtime))
        return root

    a = pack_adapter(make(tmp_path / "a", 1_000_000), tmp_path / "a.tar.gz")
    b = pack_adapter(make(tmp_path / "b", 2_000_000), tmp_path / "b.tar.gz")
    assert a.read_bytes() == b.read_bytes()
    with tarfile.open(fileobj=io.BytesIO(a.read_bytes()), mode="r:gz") as tar:
        members = tar.getmembers()
        assert [m.name for m in members] == [
            "adapter_config.json",
            "adapter_model.safetensors",
            "sub",
            "sub/README.md",
        ]
        assert {m.mtime for m in members} == {0}
        f = tar.extractfile("adapter_config.json")
        assert f is not None and f.read() == b'{"r": 8}'
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "link").symlink_to(tmp_path / "a" / "adapter_config.json")
    with pytest.raises(DeliveryError, match="is a link"):
        pack_adapter(tmp_path / "c", tmp_path / "c.tar.gz")


async def test_a_server_restart_mid_delivery_is_retried_to_completion(
    nc: Client, nats_server: NatsServer, tmp_path: Path
) -> None:
    data = random.Random(8).randbytes(12 * 1024 * 1024)
    path = tmp_path / "big"
    path.write_bytes(data)
    js = nc.jetstream()
    task = asyncio.create_task(
        deliver(js, NAMES, node="n1", job_id="j6", attempt=1, kind=ArtifactKind.GGUF,
                path=path, chunk_bytes=64 * 1024, timeout_s=1.0)
    )  # fmt: skip
    await eventually(
        lambda: js.stream_info(NAMES.artifacts_stream),
        "20 chunks in the stream before the restart",
        until=lambda info: info.state.messages >= 20,
        interval_s=0.005,
    )
    await nats_server.restart()
    size, sha = await asyncio.wait_for(task, 60)
    assert (size, sha) == (len(data), hashlib.sha256(data).hexdigest())
    chunks = await read_stream(nc, NAMES.artifact_chunks("n1", "j6", "gguf"))
    # Each chunk once (retried ones come later in the stream).
    assert sorted(h.seq for h, _, _ in chunks) == list(range(len(data) // (64 * 1024)))
    assert b"".join(b for _, _, b in sorted(chunks, key=lambda c: c[0].seq)) == data


@pytest.mark.parametrize("cut", ["at_a_chunk_boundary", "mid_chunk", "grows"])
async def test_a_file_changing_size_mid_delivery_fails_it(
    nc: Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cut: str
) -> None:
    # One chunk per read, so the change lands between reads; chunks above
    # the file object's own read buffer, so it is not hidden by buffering.
    monkeypatch.setattr(delivery, "READ_CHUNKS", 1)
    step = 64 * 1024
    path = tmp_path / "a.bin"
    path.write_bytes(os.urandom(4 * step))
    publish = AsyncPublisher.publish
    calls = 0

    async def changing(self: AsyncPublisher, *args: Any, **kwargs: Any) -> asyncio.Future[int]:
        nonlocal calls
        calls += 1
        if calls == 1:
            if cut == "grows":
                with path.open("ab") as f:
                    f.write(b"more")
            else:
                os.truncate(path, 2 * step + (0 if cut == "at_a_chunk_boundary" else 500))
        return await publish(self, *args, **kwargs)

    monkeypatch.setattr(AsyncPublisher, "publish", changing)
    with pytest.raises(DeliveryError) as e:
        await deliver(nc.jetstream(), NAMES, node="n1", job_id="j9", attempt=1,
                      kind=ArtifactKind.GGUF, path=path, chunk_bytes=step)  # fmt: skip
    assert ("changed size" if cut == "grows" else "shrank") in str(e.value)
