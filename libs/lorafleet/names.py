"""Every subject, stream, bucket and consumer name lorafleet uses, in one place.

All names derive from one prefix (LORAFLEET_SUBJECT_PREFIX, default
"lorafleet"): subjects start with `<prefix>.`, buckets with `<prefix>_`,
streams with `<PREFIX>_`. Two installations with different prefixes share a
NATS account without seeing each other.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_PREFIX_RE = re.compile(r"^[A-Za-z0-9_-]{1,32}$")
_TOKEN_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

DEFAULT_PREFIX = "lorafleet"


class InvalidNameError(ValueError):
    """A prefix, node name or job id that cannot be part of a subject."""


def check_token(value: str, what: str) -> str:
    """Return `value` when it is a subject-safe token, else raise InvalidNameError."""
    if not _TOKEN_RE.match(value):
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
        if not _PREFIX_RE.match(self.prefix):
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
    def models_add(self) -> str:
        return self.api("models", "add")

    @property
    def models_list(self) -> str:
        return self.api("models", "list")

    @property
    def nodes_list(self) -> str:
        return self.api("nodes", "list")

    @property
    def artifacts_list(self) -> str:
        return self.api("artifacts", "list")

    @property
    def artifacts_get(self) -> str:
        return self.api("artifacts", "get")

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

    def node_status_subjects(self, node: str) -> str:
        """Every status subject of one node (`<prefix>.status.<node>.>`)."""
        return f"{self.prefix}.status.{check_token(node, 'node name')}.>"

    def node_artifact_subjects(self, node: str) -> str:
        """Every artifact chunk subject of one node (`<prefix>.artifacts.<node>.>`)."""
        return f"{self.prefix}.artifacts.{check_token(node, 'node name')}.>"

    def kv_subject(self, bucket: str, key: str) -> str:
        """The subject a KV bucket's `key` is stored under (a JetStream publish
        there is a put that can carry a per-message TTL, which kv.put cannot)."""
        return f"$KV.{bucket}.{key}"

    def node_heartbeat(self, node: str) -> str:
        """The subject a node's heartbeat is put to: its key in the nodes KV."""
        return self.kv_subject(self.nodes_bucket, check_token(node, "node name"))

    # --- streams ---
    @property
    def status_stream(self) -> str:
        return f"{self.prefix.upper()}_STATUS"

    @property
    def status_subjects(self) -> str:
        return f"{self.prefix}.status.>"

    def status(self, node: str, job_id: str) -> str:
        return f"{self.prefix}.status.{node}.{job_id}"

    @property
    def artifacts_stream(self) -> str:
        return f"{self.prefix.upper()}_ARTIFACTS"

    @property
    def artifacts_subjects(self) -> str:
        return f"{self.prefix}.artifacts.>"

    def artifact_chunks(self, node: str, job_id: str, kind: str) -> str:
        return f"{self.prefix}.artifacts.{node}.{job_id}.{kind}"

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
    def datasets_bucket(self) -> str:
        return f"{self.prefix}_datasets"

    @property
    def artifacts_bucket(self) -> str:
        return f"{self.prefix}_artifacts"

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
