"""Every message lorafleet puts on NATS, as msgspec Structs, one module per
domain: fields (constrained types), errors, catalog, jobs, job_store (the
recorder's internal API), nodes, status, trainer_lines, artifacts. Import
them from here: `from lorafleet_schemas.messages import JobSpec`.

These are the wire shapes. The JSON Schemas in schemas/json/ are generated
from them (`python -m lorafleet_schemas.generate`); a test fails when the
checked-in files are stale. Rules for change: a new field always gets a
default, so that older senders stay valid; nothing is renamed in place.

Times are UTC datetimes, sizes are bytes unless the name says MiB, and
durations carry their unit in the name.
"""

from __future__ import annotations

from lorafleet_schemas.messages.artifacts import (
    ArtifactChunkHeader,
    ArtifactGetRequest,
    ArtifactKind,
    ArtifactList,
    ArtifactListRequest,
    ArtifactRecord,
)
from lorafleet_schemas.messages.catalog import (
    Engine,
    ModelArchitecture,
    ModelList,
    ModelListRequest,
    ModelRecord,
    ModelSpec,
)
from lorafleet_schemas.messages.errors import (
    ErrorBody,
    ErrorCode,
    ErrorReply,
)
from lorafleet_schemas.messages.fields import (
    PositiveMiB,
    Sha256Hex,
    SubjectToken,
)
from lorafleet_schemas.messages.job_store import (
    ArtifactStoredRequest,
    TransitionReply,
    TransitionRequest,
)
from lorafleet_schemas.messages.jobs import (
    CheckpointRef,
    EstimateLine,
    EvalPoint,
    JobCancelRequest,
    JobCurve,
    JobCurveRequest,
    JobEstimate,
    JobEstimateRequest,
    JobEvent,
    JobEventRecord,
    JobGetRequest,
    JobList,
    JobListRequest,
    JobRecord,
    JobResumeRequest,
    JobSpec,
    JobState,
    LossPoint,
    MemoryEstimate,
    TrainerParams,
)
from lorafleet_schemas.messages.nodes import (
    Card,
    EnginesInstalled,
    Heartbeat,
    NodeCancelReply,
    NodeCancelRequest,
    NodeInfo,
    NodeList,
    NodeListRequest,
    StartReply,
    StartRequest,
)
from lorafleet_schemas.messages.status import (
    StatusReport,
)
from lorafleet_schemas.messages.trainer_lines import (
    TrainerCheckpoint,
    TrainerDone,
    TrainerError,
    TrainerEval,
    TrainerLengths,
    TrainerLine,
    TrainerLog,
    TrainerState,
    TrainerStep,
)

__all__ = [
    "PUBLISHED",
    "ArtifactChunkHeader",
    "ArtifactGetRequest",
    "ArtifactKind",
    "ArtifactList",
    "ArtifactListRequest",
    "ArtifactRecord",
    "ArtifactStoredRequest",
    "Card",
    "CheckpointRef",
    "Engine",
    "EnginesInstalled",
    "ErrorBody",
    "ErrorCode",
    "ErrorReply",
    "EstimateLine",
    "EvalPoint",
    "Heartbeat",
    "JobCancelRequest",
    "JobCurve",
    "JobCurveRequest",
    "JobEstimate",
    "JobEstimateRequest",
    "JobEvent",
    "JobEventRecord",
    "JobGetRequest",
    "JobList",
    "JobListRequest",
    "JobRecord",
    "JobResumeRequest",
    "JobSpec",
    "JobState",
    "LossPoint",
    "MemoryEstimate",
    "ModelArchitecture",
    "ModelList",
    "ModelListRequest",
    "ModelRecord",
    "ModelSpec",
    "NodeCancelReply",
    "NodeCancelRequest",
    "NodeInfo",
    "NodeList",
    "NodeListRequest",
    "PositiveMiB",
    "Sha256Hex",
    "StartReply",
    "StartRequest",
    "StatusReport",
    "SubjectToken",
    "TrainerCheckpoint",
    "TrainerDone",
    "TrainerError",
    "TrainerEval",
    "TrainerLengths",
    "TrainerLine",
    "TrainerLog",
    "TrainerParams",
    "TrainerState",
    "TrainerStep",
    "TransitionReply",
    "TransitionRequest",
]

#: Every message with a published schema: file name -> Struct (or union).
PUBLISHED: dict[str, object] = {
    "error": ErrorReply,
    "model-spec": ModelSpec,
    "model-record": ModelRecord,
    "model-list-request": ModelListRequest,
    "model-list": ModelList,
    "trainer-params": TrainerParams,
    "job-spec": JobSpec,
    "job-record": JobRecord,
    "job-get-request": JobGetRequest,
    "job-list-request": JobListRequest,
    "job-list": JobList,
    "job-cancel-request": JobCancelRequest,
    "job-resume-request": JobResumeRequest,
    "checkpoint-ref": CheckpointRef,
    "job-curve-request": JobCurveRequest,
    "job-curve": JobCurve,
    "job-estimate-request": JobEstimateRequest,
    "job-estimate": JobEstimate,
    "job-event": JobEvent,
    "transition-request": TransitionRequest,
    "transition-reply": TransitionReply,
    "artifact-stored-request": ArtifactStoredRequest,
    "start-request": StartRequest,
    "start-reply": StartReply,
    "node-cancel-request": NodeCancelRequest,
    "node-cancel-reply": NodeCancelReply,
    "heartbeat": Heartbeat,
    "node-list-request": NodeListRequest,
    "node-list": NodeList,
    "status-report": StatusReport,
    "trainer-line": TrainerLine,
    "artifact-chunk-header": ArtifactChunkHeader,
    "artifact-record": ArtifactRecord,
    "artifact-list-request": ArtifactListRequest,
    "artifact-list": ArtifactList,
    "artifact-get-request": ArtifactGetRequest,
}
