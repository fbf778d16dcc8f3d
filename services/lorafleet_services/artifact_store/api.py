"""The artifact-store's requests: `api.artifacts.list` and `api.artifacts.get`.

Both read the object store's info messages (`lorafleet.artifacts`), so
any replica answers the same; an object is listed only once committed.
"""

from __future__ import annotations

from nats.js import JetStreamContext

from lorafleet.artifacts import get_record, list_records
from lorafleet.errors import NotFoundError
from lorafleet.names import Names
from lorafleet.nats._micro import Route
from lorafleet_schemas.messages import (
    ArtifactGetRequest,
    ArtifactList,
    ArtifactListRequest,
    ArtifactRecord,
)


class ArtifactApi:
    """The handlers, on one JetStream context."""

    def __init__(self, js: JetStreamContext, names: Names) -> None:
        self.js = js
        self.names = names

    def routes(self) -> list[Route]:
        return [
            Route(self.names.artifacts_list, ArtifactListRequest, self.list_artifacts),
            Route(self.names.artifacts_get, ArtifactGetRequest, self.get_artifact),
        ]

    async def list_artifacts(self, req: ArtifactListRequest) -> ArtifactList:
        """Every stored artifact of the job, in ArtifactKind order (none: an empty list)."""
        return ArtifactList(artifacts=await list_records(self.js, self.names, req.job_id))

    async def get_artifact(self, req: ArtifactGetRequest) -> ArtifactRecord:
        """The stored artifact; NotFoundError (`not_found`, at `$.kind`) when there is none."""
        rec = await get_record(self.js, self.names, req.job_id, req.kind.value)
        if rec is None:
            raise NotFoundError(
                f"job {req.job_id} has no stored {req.kind.value} artifact", "$.kind"
            )
        return rec
