"""`api.artifacts.list/get` handlers in this process, against a real nats-server."""

from __future__ import annotations

import hashlib

import pytest
from nats.aio.client import Client

from lorafleet.artifacts import AsyncPublisher
from lorafleet.errors import NotFoundError
from lorafleet.names import Names
from lorafleet_schemas.messages import ArtifactGetRequest, ArtifactKind, ArtifactListRequest
from lorafleet_services.artifact_store.api import ArtifactApi
from lorafleet_services.artifact_store.delivery import Deliveries
from lorafleet_services.artifact_store.streams import Streams
from tests.artifacts.conftest import chunks_of, publish
from tests.artifacts.fakes import FakeClock, FakeRecorder, job

N = Names()


async def test_nothing_stored_lists_empty_and_get_is_not_found(nc: Client) -> None:
    api = ArtifactApi(nc.jetstream(), N)
    assert [r.subject for r in api.routes()] == [N.artifacts_list, N.artifacts_get]
    assert (await api.list_artifacts(ArtifactListRequest(job_id="job1"))).artifacts == []
    with pytest.raises(NotFoundError) as e:
        await api.get_artifact(ArtifactGetRequest(job_id="job1", kind=ArtifactKind.GGUF))
    assert (e.value.message, e.value.field) == ("job job1 has no stored gguf artifact", "$.kind")


async def test_a_committed_artifact_is_listed_and_got(
    nc: Client, publisher: AsyncPublisher
) -> None:
    data = b"adapter" * 1000
    await publish(nc, job(), ArtifactKind.PEFT, chunks_of(job(), ArtifactKind.PEFT, data, 1000))
    recorder = FakeRecorder(job())
    await Deliveries(Streams(nc.jetstream(), N), publisher, recorder, FakeClock()).recover_all()
    api = ArtifactApi(nc.jetstream(), N)
    got = await api.get_artifact(ArtifactGetRequest(job_id="job1", kind=ArtifactKind.PEFT))
    assert (got.job_id, got.kind, got.size) == ("job1", ArtifactKind.PEFT, len(data))
    assert (got.sha256, got.node, got.base_model) == (
        hashlib.sha256(data).hexdigest(),
        "node-a",
        "tiny",
    )
    listed = await api.list_artifacts(ArtifactListRequest(job_id="job1"))
    assert listed.artifacts == [got]
