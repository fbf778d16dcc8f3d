"""Every subject, stream, bucket and consumer name lorafleet uses, in one place.

All names derive from one prefix (LORAFLEET_SUBJECT_PREFIX, default
"lorafleet"): subjects start with `<prefix>.`, buckets with `<prefix>_`,
streams with `<PREFIX>_`. Two installations with different prefixes share a
NATS account without seeing each other.

NATS's own names live here too: the subjects and streams behind KV buckets
(`$KV.<bucket>.<key>` on `KV_<bucket>`) and object stores (`$O.<bucket>.M.*`
and `.C.*` on `OBJ_<bucket>`), the JetStream API subjects lorafleet grants
or calls, and every header name (`Header`), lorafleet's own included.
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass
from typing import Final

from lorafleet_schemas.messages.fields import SUBJECT_TOKEN_PATTERN

_PREFIX_RE = re.compile(r"^[A-Za-z0-9_-]{1,32}$")
_TOKEN_RE = re.compile(SUBJECT_TOKEN_PATTERN)

DEFAULT_PREFIX = "lorafleet"


class InvalidNameError(ValueError):
    """A prefix, node name or job id that cannot be part of a subject."""


def check_token(value: str, what: str) -> str:
    """Return `value` when it is a subject-safe token, else raise InvalidNameError."""
    if not _TOKEN_RE.fullmatch(value):
        raise InvalidNameError(
            f"{what} {value!r} cannot be part of a NATS subject: use 1 to 64 letters, "
            "digits, '-' or '_'"
        )
    return value


@dataclass(frozen=True, slots=True)
class Names:
    """The names under one prefix. `Names()` is the default installation's."""

    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        if not _PREFIX_RE.fullmatch(self.prefix):
            raise InvalidNameError(
                f"subject prefix {self.prefix!r}: use 1 to 32 letters, digits, '-' or '_'"
            )

    # --- request/reply API (clients) ---
    def api(self, group: str, verb: str) -> str:
        return f"{self.prefix}.api.{group}.{verb}"

    @property
    def jobs_submit(self) -> str:
        return self.api("jobs", "submit")

    @property
    def jobs_get(self) -> str:
        return self.api("jobs", "get")

    @property
    def jobs_list(self) -> str:
        return self.api("jobs", "list")

    @property
    def jobs_curve(self) -> str:
        return self.api("jobs", "curve")

    @property
    def jobs_cancel(self) -> str:
        return self.api("jobs", "cancel")

    @property
    def jobs_resume(self) -> str:
        return self.api("jobs", "resume")

    @property
    def jobs_delete(self) -> str:
        return self.api("jobs", "delete")

    @property
    def jobs_estimate(self) -> str:
        return self.api("jobs", "estimate")

    @property
    def models_add(self) -> str:
        return self.api("models", "add")

    @property
    def models_list(self) -> str:
        return self.api("models", "list")

    @property
    def nodes_list(self) -> str:
        return self.api("nodes", "list")

    @property
    def nodes_schedule(self) -> str:
        """Cordon, drain or uncordon a node (the scheduler's)."""
        return self.api("nodes", "schedule")

    @property
    def artifacts_list(self) -> str:
        return self.api("artifacts", "list")

    @property
    def artifacts_get(self) -> str:
        return self.api("artifacts", "get")

    @property
    def artifacts_gc(self) -> str:
        """Retention of the artifacts bucket (the artifact-store)."""
        return self.api("artifacts", "gc")

    @property
    def datasets_gc(self) -> str:
        """Retention of the datasets bucket (the recorder)."""
        return self.api("datasets", "gc")

    @property
    def adapters_serve(self) -> str:
        return self.api("adapters", "serve")

    @property
    def adapters_unserve(self) -> str:
        return self.api("adapters", "unserve")

    @property
    def adapters_list(self) -> str:
        return self.api("adapters", "list")

    # --- internal request/reply (services -> recorder) ---
    @property
    def store_transition(self) -> str:
        return f"{self.prefix}.store.jobs.transition"

    @property
    def store_artifact(self) -> str:
        return f"{self.prefix}.store.jobs.artifact"

    # --- node-scoped (scheduler -> agent) ---
    def node_start(self, node: str) -> str:
        return f"{self.prefix}.node.{check_token(node, 'node name')}.start"

    def node_cancel(self, node: str) -> str:
        return f"{self.prefix}.node.{check_token(node, 'node name')}.cancel"

    def node_checkpoint(self, node: str) -> str:
        return f"{self.prefix}.node.{check_token(node, 'node name')}.checkpoint"

    def node_serve(self, node: str) -> str:
        return f"{self.prefix}.node.{check_token(node, 'node name')}.serve"

    def node_unserve(self, node: str) -> str:
        return f"{self.prefix}.node.{check_token(node, 'node name')}.unserve"

    def node_status_subjects(self, node: str) -> str:
        """Every status subject of one node (`<prefix>.status.<node>.>`)."""
        return f"{self.prefix}.status.{check_token(node, 'node name')}.>"

    def node_artifact_subjects(self, node: str) -> str:
        """Every artifact chunk subject of one node (`<prefix>.artifacts.<node>.>`)."""
        return f"{self.prefix}.artifacts.{check_token(node, 'node name')}.>"

    def kv_subject(self, bucket: str, key: str) -> str:
        """The subject a KV bucket's `key` is stored under (a JetStream publish
        there is a put that can carry a per-message TTL, which kv.put cannot)."""
        return kv_subject(bucket, key)

    def node_heartbeat(self, node: str) -> str:
        """The subject a node's heartbeat is put to: its key in the nodes KV."""
        return kv_subject(self.nodes_bucket, check_token(node, "node name"))

    # --- streams ---
    @property
    def status_stream(self) -> str:
        return f"{self.prefix.upper()}_STATUS"

    @property
    def status_subjects(self) -> str:
        return f"{self.prefix}.status.>"

    def status(self, node: str, job_id: str) -> str:
        return f"{self.prefix}.status.{node}.{job_id}"

    def serving_report(self, node: str, job_id: str) -> str:
        """Where the agent reports a serving change (ServingReport): in the
        status stream, beside the job's status reports."""
        return f"{self.prefix}.status.{node}.{job_id}.serving"

    def is_serving_report(self, subject: str) -> bool:
        """True for a `serving_report` subject (the status stream holds both kinds)."""
        head = f"{self.prefix}.status."
        rest = subject[len(head) :].split(".") if subject.startswith(head) else []
        return len(rest) == 3 and rest[-1] == "serving"

    @property
    def artifacts_stream(self) -> str:
        return f"{self.prefix.upper()}_ARTIFACTS"

    @property
    def artifacts_subjects(self) -> str:
        return f"{self.prefix}.artifacts.>"

    def artifact_chunks(self, node: str, job_id: str, kind: str) -> str:
        return f"{self.prefix}.artifacts.{node}.{job_id}.{kind}"

    def artifact_chunks_parts(self, subject: str) -> tuple[str, str, str]:
        """(node, job, kind) of an `artifact_chunks` subject, its inverse;
        InvalidNameError when `subject` is none."""
        head = f"{self.prefix}.artifacts."
        parts = subject[len(head) :].split(".") if subject.startswith(head) else []
        if len(parts) != 3 or not all(parts):
            raise InvalidNameError(
                f"{subject!r} is not an artifact chunk subject ({head}<node>.<job>.<kind>)"
            )
        node, job_id, kind = parts
        return node, job_id, kind

    # --- events (recorder -> watchers, after commit) ---
    def job_events(self, job_id: str) -> str:
        return f"{self.prefix}.events.jobs.{job_id}"

    @property
    def all_job_events(self) -> str:
        return f"{self.prefix}.events.jobs.*"

    # --- KV and object stores ---
    @property
    def nodes_bucket(self) -> str:
        return f"{self.prefix}_nodes"

    @property
    def leader_bucket(self) -> str:
        return f"{self.prefix}_leader"

    @property
    def node_marks_bucket(self) -> str:
        """Cordoned and drained nodes (NodeMark), kept until uncordoned."""
        return f"{self.prefix}_node_marks"

    @property
    def datasets_bucket(self) -> str:
        return f"{self.prefix}_datasets"

    @property
    def artifacts_bucket(self) -> str:
        return f"{self.prefix}_artifacts"

    @property
    def gateway_bucket(self) -> str:
        """The HTTP gateway's own KV: its file objects and jobs' OpenAI fields."""
        return f"{self.prefix}_gateway"

    # --- durable consumers ---
    @property
    def recorder_consumer(self) -> str:
        return "recorder"

    @property
    def artifact_store_consumer(self) -> str:
        return "artifact-store"

    # --- micro service names (`nats micro ls`) ---
    @property
    def recorder_service(self) -> str:
        return f"{self.prefix}-recorder"

    @property
    def scheduler_service(self) -> str:
        return f"{self.prefix}-scheduler"

    @property
    def artifact_store_service(self) -> str:
        return f"{self.prefix}-artifact-store"

    # --- queue groups (replicated services share work) ---
    @property
    def queue_group(self) -> str:
        return f"{self.prefix}-q"


def node_inbox_prefix(node: str) -> str:
    """The reply inbox prefix of a node's agent (`_INBOX_<node>`): with it a
    node's credentials subscribe to its own replies only."""
    return f"_INBOX_{check_token(node, 'node name')}"


def dataset_object_name(sha256_hex: str) -> str:
    """The object name inline data is stored under in the datasets bucket."""
    return f"sha256/{sha256_hex}"


def artifact_object_name(job_id: str, kind: str) -> str:
    return f"{job_id}/{kind}"


# --- NATS's own names: KV and object-store subjects and streams ----------------


def kv_stream(bucket: str) -> str:
    """The stream behind a KV bucket."""
    return f"KV_{bucket}"


def kv_subject(bucket: str, key: str) -> str:
    """The subject a KV bucket's `key` is stored under."""
    return f"$KV.{bucket}.{key}"


def kv_subjects(bucket: str) -> str:
    """Every key subject of a KV bucket (`$KV.<bucket>.>`)."""
    return f"$KV.{bucket}.>"


def object_stream(bucket: str) -> str:
    """The stream behind an object-store bucket."""
    return f"OBJ_{bucket}"


def object_meta_subject(bucket: str, name: str) -> str:
    """The subject of an object's meta (info) message: its name, base64url."""
    return f"$O.{bucket}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"


def object_meta_subjects(bucket: str) -> str:
    """Every meta subject of an object-store bucket (`$O.<bucket>.M.>`)."""
    return f"$O.{bucket}.M.>"


def object_chunk_subject(bucket: str, nuid: str) -> str:
    """The subject an object's chunks go on (`nuid` is its info's)."""
    return f"$O.{bucket}.C.{nuid}"


def object_chunk_subjects(bucket: str) -> str:
    """Every chunk subject of an object-store bucket (`$O.<bucket>.C.>`)."""
    return f"$O.{bucket}.C.>"


#: The object store's digest field prefix for a sha256 (`SHA-256=<base64url>`).
OBJECT_DIGEST_PREFIX: Final = "SHA-256="


def object_subjects(bucket: str) -> str:
    """Every subject of an object-store bucket (`$O.<bucket>.>`)."""
    return f"$O.{bucket}.>"


# --- the JetStream API and other server subjects --------------------------------

#: Every JetStream API request subject.
JS_API_SUBJECTS: Final = "$JS.API.>"
#: Every JetStream acknowledgement subject.
JS_ACK_SUBJECTS: Final = "$JS.ACK.>"
#: Every JetStream flow-control subject.
JS_FLOW_CONTROL_SUBJECTS: Final = "$JS.FC.>"
#: Every micro service discovery subject (`$SRV.PING`, `.INFO`, `.STATS`).
SERVICE_DISCOVERY_SUBJECTS: Final = "$SRV.>"


def stream_msg_get_subject(stream: str) -> str:
    """The JetStream API subject of a direct message get on `stream`."""
    return f"$JS.API.STREAM.MSG.GET.{stream}"


def stream_direct_get_subject(stream: str) -> str:
    """The JetStream API subject of a (batched) direct get on `stream`; any
    replica answers it, not only the leader (the stream needs allow_direct)."""
    return f"$JS.API.DIRECT.GET.{stream}"


def js_api_subject(*tokens: str) -> str:
    """A JetStream API request subject, `$JS.API.<tokens...>` (what a grant names:
    `js_api_subject("STREAM", "INFO", stream)`)."""
    return ".".join(("$JS.API", *tokens))


def js_ack_subjects(stream: str, consumer: str) -> str:
    """Every ack subject of one consumer (`$JS.ACK.<stream>.<consumer>.>`)."""
    return f"$JS.ACK.{stream}.{consumer}.>"


def js_flow_control_subjects(stream: str) -> str:
    """Every flow-control subject of one stream's consumers (`$JS.FC.<stream>.>`)."""
    return f"$JS.FC.{stream}.>"


def msg_get_subject(bucket: str) -> str:
    """The one JetStream API subject `read_object` requests on an object-store
    bucket (what a reader's permissions must allow)."""
    return stream_msg_get_subject(object_stream(bucket))


def object_read_subjects(bucket: str) -> tuple[str, str]:
    """Every JetStream API subject `read_object` requests on an object-store
    bucket: the message get (the object's info, from the leader) and the
    batched direct get (its chunks)."""
    return msg_get_subject(bucket), stream_direct_get_subject(object_stream(bucket))


# --- message ids (Header.MSG_ID) --------------------------------------------------
# A JetStream stream stores a message whose id it saw within its duplicate
# window once: a retried publish is the same id. Two messages that must both
# be stored need different ids in the same stream.


def status_msg_id(job_id: str, attempt: int, seq: int) -> str:
    """The id of a job's status report: one per job, attempt and report."""
    return f"{job_id}.{attempt}.{seq}"


def serving_msg_id(node: str, seq: int) -> str:
    """The id of a node's serving report (`seq` grows per node), in the
    status stream beside `status_msg_id`s, which never hold "serving"."""
    return f"{node}.serving.{seq}"


def chunk_msg_id(job_id: str, kind: str, attempt: int, seq: int, step: int | None = None) -> str:
    """The id of one artifact chunk.

    `step`: a checkpoint's optimizer step. One attempt delivers many
    checkpoints, and without it chunk 0 of the second would be taken for a
    repeat of the first's (the stream's duplicate window) and dropped.
    """
    if step is None:
        return f"{job_id}.{kind}.{attempt}.{seq}"
    return f"{job_id}.{kind}.{attempt}.{step}.{seq}"


# --- headers --------------------------------------------------------------------


class Header:
    """Every header name lorafleet writes or reads (NATS's and its own)."""

    #: JetStream de-duplication: a publish with a seen id is stored once.
    MSG_ID: Final = "Nats-Msg-Id"
    #: JetStream compare-and-set: stored only if the subject's last sequence is this.
    EXPECTED_LAST_SUBJECT_SEQUENCE: Final = "Nats-Expected-Last-Subject-Sequence"
    #: JetStream rollup: `ROLLUP_SUBJECT` keeps only this message on its subject.
    ROLLUP: Final = "Nats-Rollup"
    #: Set on a KV delete or purge (`KV_DEL`, `KV_PURGE`).
    KV_OPERATION: Final = "KV-Operation"
    #: Set on the marker the server leaves when a per-message TTL expires.
    MARKER_REASON: Final = "Nats-Marker-Reason"
    #: A micro error reply's description.
    SERVICE_ERROR: Final = "Nats-Service-Error"
    #: A micro error reply's code (HTTP-like: "400", "404", ...).
    SERVICE_ERROR_CODE: Final = "Nats-Service-Error-Code"
    #: The server's status of a reply ("503" when no one answered).
    STATUS: Final = "Status"
    #: A direct get's answer: the message's stream sequence.
    SEQUENCE: Final = "Nats-Sequence"
    #: A batched direct get's answer: messages left on the subject after this
    #: one (absent from an older server's single answer).
    NUM_PENDING: Final = "Nats-Num-Pending"
    #: lorafleet's: an ArtifactChunkHeader as JSON on each artifact chunk.
    CHUNK: Final = "Lorafleet-Chunk"


#: `Header.KV_OPERATION` of a KV delete.
KV_DEL: Final = "DEL"
#: `Header.KV_OPERATION` of a KV purge.
KV_PURGE: Final = "PURGE"
#: `Header.ROLLUP` value that keeps one message per subject.
ROLLUP_SUBJECT: Final = "sub"
#: `Header.STATUS` of a request no one answered.
STATUS_NO_RESPONDERS: Final = "503"
#: `Header.STATUS` of the message that ends a batched direct get's answer.
STATUS_END_OF_BATCH: Final = "204"
