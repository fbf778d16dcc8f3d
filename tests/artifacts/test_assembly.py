"""Chunk assembly and the delivery rules, with no bus."""

from __future__ import annotations

import datetime as dt
import hashlib
import random

import msgspec
import pytest

from lorafleet.artifacts import (
    ObjectInfo,
    decode_info,
    object_digest,
    record_from_info,
)
from lorafleet.names import Header, Names
from lorafleet_schemas.messages import (
    ArtifactChunkHeader,
    ArtifactKind,
    JobState,
)
from lorafleet_services.artifact_store.assembly import (
    Assembly,
    AssemblyError,
    ChunkError,
    Key,
    VerifiedArtifact,
    delivery_refusal_reason,
    is_committed_by,
    object_chunk_token,
    object_info,
    parse_chunk,
)
from tests.artifacts.fakes import job

KEY = Key("node-a", "job1", ArtifactKind.PEFT, 1)


def headers_for(data: bytes, step: int) -> list[tuple[ArtifactChunkHeader, bytes]]:
    bodies = [data[i : i + step] for i in range(0, len(data), step)] or [b""]
    out = []
    for seq, body in enumerate(bodies):
        h = ArtifactChunkHeader(
            job_id="job1", node="node-a", kind=ArtifactKind.PEFT, attempt=1, seq=seq
        )
        if seq == len(bodies) - 1:
            h = msgspec.structs.replace(
                h,
                last=True,
                count=len(bodies),
                size=len(data),
                sha256=hashlib.sha256(data).hexdigest(),
            )
        out.append((h, body))
    return out


def assemble(chunks: list[tuple[ArtifactChunkHeader, bytes]]) -> tuple[Assembly, bytes]:
    a = Assembly(KEY)
    written = b"".join(b"".join(a.add(h, body)) for h, body in chunks)
    return a, written


def test_in_order_assembles_and_verifies() -> None:
    data = random.Random(1).randbytes(10_000)
    a, written = assemble(headers_for(data, 1000))
    assert written == data
    assert a.complete
    assert a.verify() == VerifiedArtifact(
        size=10_000, sha256=hashlib.sha256(data).hexdigest(), count=10
    )


def test_duplicates_and_reordering_give_the_same_bytes() -> None:
    data = random.Random(2).randbytes(7_777)
    chunks = headers_for(data, 500)
    rng = random.Random(3)
    body = chunks[:-1] + chunks[:-1][::3]  # duplicates
    rng.shuffle(body)
    a, written = assemble([*body, chunks[-1], chunks[4]])
    assert written == data
    assert a.verify().sha256 == hashlib.sha256(data).hexdigest()


def test_empty_artifact_is_one_empty_last_chunk() -> None:
    a, written = assemble(headers_for(b"", 100))
    assert written == b""
    assert a.verify() == VerifiedArtifact(size=0, sha256=hashlib.sha256(b"").hexdigest(), count=1)


def test_missing_chunk_is_short() -> None:
    chunks = headers_for(random.Random(4).randbytes(5000), 1000)
    a, _ = assemble([c for c in chunks if c[0].seq != 2])
    assert a.missing() == [2]
    with pytest.raises(AssemblyError, match=r"short: 1 of its 5 chunks never arrived \(chunk 2\)"):
        a.verify()


def test_wrong_sha256_is_corrupt() -> None:
    data = random.Random(5).randbytes(3000)
    chunks = headers_for(data, 1000)
    h, body = chunks[-1]
    chunks[-1] = (msgspec.structs.replace(h, sha256="0" * 64), body)
    a, _ = assemble(chunks)
    with pytest.raises(AssemblyError, match="corrupt: its sha256 is"):
        a.verify()


def test_wrong_size_is_named() -> None:
    data = random.Random(6).randbytes(3000)
    chunks = headers_for(data, 1000)
    h, body = chunks[-1]
    chunks[-1] = (msgspec.structs.replace(h, size=2999), body)
    a, _ = assemble(chunks)
    with pytest.raises(AssemblyError, match="is 3000 bytes, but the delivery said 2999"):
        a.verify()


def test_chunk_beyond_count_is_refused() -> None:
    chunks = headers_for(b"x" * 3000, 1000)
    extra = (msgspec.structs.replace(chunks[0][0], seq=7), b"y")
    a = Assembly(KEY)
    a.add(*extra)
    for h, body in chunks:
        a.add(h, body)
    with pytest.raises(AssemblyError, match="chunk 7 is beyond the count 3"):
        a.verify()
    with pytest.raises(AssemblyError, match="beyond the count"):
        a.add(msgspec.structs.replace(chunks[0][0], seq=9), b"z")


def test_parse_chunk_checks_subject_against_header() -> None:
    names = Names()
    h = ArtifactChunkHeader(job_id="job1", node="node-a", kind=ArtifactKind.GGUF, attempt=2, seq=0)
    raw = {Header.CHUNK: msgspec.json.encode(h).decode()}
    chunk = parse_chunk(names, "lorafleet.artifacts.node-a.job1.gguf", raw)
    assert chunk.key == Key("node-a", "job1", ArtifactKind.GGUF, 2)
    with pytest.raises(
        ChunkError, match=r"was published on lorafleet\.artifacts\.node-b\.job1\.gguf"
    ):
        parse_chunk(names, "lorafleet.artifacts.node-b.job1.gguf", raw)
    with pytest.raises(ChunkError, match="is not an artifact chunk subject"):
        parse_chunk(names, "lorafleet.artifacts.node-a.job1", raw)
    with pytest.raises(ChunkError, match="no Lorafleet-Chunk header"):
        parse_chunk(names, "lorafleet.artifacts.node-a.job1.gguf", {})
    with pytest.raises(ChunkError, match="not valid"):
        parse_chunk(names, "lorafleet.artifacts.node-a.job1.gguf", {Header.CHUNK: "{"})
    last = msgspec.structs.replace(h, last=True)
    with pytest.raises(ChunkError, match="lacks its count"):
        parse_chunk(
            names,
            "lorafleet.artifacts.node-a.job1.gguf",
            {Header.CHUNK: msgspec.json.encode(last).decode()},
        )


def test_refusal_rules() -> None:
    assert delivery_refusal_reason(job(), KEY) is None
    assert delivery_refusal_reason(job(state=JobState.RUNNING), KEY) is None
    assert "does not exist" in (delivery_refusal_reason(None, KEY) or "")
    assert "assigned to node 'node-b', not 'node-a'" in (
        delivery_refusal_reason(job(node="node-b"), KEY) or ""
    )
    assert "attempt 2" in (delivery_refusal_reason(job(attempt=2), KEY) or "")
    assert "is failed" in (delivery_refusal_reason(job(state=JobState.FAILED), KEY) or "")
    assert "is queued" in (delivery_refusal_reason(job(state=JobState.QUEUED), KEY) or "")
    assert "not peft" in (
        delivery_refusal_reason(job(artifacts_expected=[ArtifactKind.GGUF]), KEY) or ""
    )


def test_object_info_reads_back_as_a_record() -> None:
    names = Names()
    whole = VerifiedArtifact(size=3, sha256=hashlib.sha256(b"abc").hexdigest(), count=1)
    now = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
    nuid = object_chunk_token(KEY, "w1")
    info = object_info(
        names, KEY, whole, chunks=1, chunk_bytes=3, base_model="tiny", now=now, nuid=nuid
    )
    assert info["nuid"] == "job1.peft.1.w1"
    assert info["digest"] == object_digest(whole.sha256)
    assert info["name"] == "job1/peft"
    decoded = decode_info(msgspec.json.encode(info))
    assert isinstance(decoded, ObjectInfo)
    rec = record_from_info(decoded)
    assert rec is not None
    assert (
        rec.job_id,
        rec.kind,
        rec.size,
        rec.sha256,
        rec.base_model,
        rec.node,
        rec.stored_at,
    ) == (
        "job1",
        ArtifactKind.PEFT,
        3,
        whole.sha256,
        "tiny",
        "node-a",
        now,
    )
    assert record_from_info(msgspec.structs.replace(decoded, deleted=True)) is None


def test_object_tokens() -> None:
    mine = object_chunk_token(KEY, "abc")
    assert is_committed_by(mine, KEY)
    assert not is_committed_by(object_chunk_token(Key("n", "job1", ArtifactKind.PEFT, 2), "x"), KEY)
    assert not is_committed_by(object_chunk_token(Key("n", "job1", ArtifactKind.GGUF, 1), "x"), KEY)
    assert not is_committed_by("job10.peft.1.abc", KEY)
