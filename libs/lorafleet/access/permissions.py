"""NATS permissions for lorafleet: what a node's agent and the services may do.

The blocks are nats-server's own shape (`{"publish": {"allow": [...]},
"subscribe": {"allow": [...]}, "allow_responses": true}`), built from
names.py's subject builders, usable in a server config
(`lorafleet.nats.config`), an operator's JWT tooling, or read by a person.
Everything not allowed is denied. The agent of node N may only put its own
heartbeat, publish its own status reports and artifact chunks, read the
datasets and artifacts buckets by message and direct gets (which cannot write, purge
or delete: a resumed job fetches its checkpoint), receive its own
start/cancel/serve/unserve requests and answer them, and read replies on
its own inboxes (`_INBOX_N.>`). With nkey identities each service has its
own block, allowed only what it uses, and creates only the JetStream pieces
it owns (`LAYOUT_OWNERS`); who may do what, per identity:
docs/deploy.md. The older shared-password form is `lorafleet.access.passwords`.
"""

from __future__ import annotations

from typing import Any

from lorafleet.names import (
    SERVICE_DISCOVERY_SUBJECTS,
    Names,
    check_token,
    js_ack_subjects,
    js_api_subject,
    js_flow_control_subjects,
    kv_stream,
    kv_subjects,
    node_inbox_prefix,
    object_chunk_subjects,
    object_meta_subjects,
    object_read_subjects,
    object_stream,
    object_subjects,
)

#: A permission block as nats-server reads it.
Permissions = dict[str, Any]

#: The inbox prefix of processes that keep nats-py's default.
DEFAULT_INBOX = "_INBOX"


class PermissionsError(ValueError):
    """A name, key, password or TLS setting that cannot go into a server config."""


def agent_permissions(names: Names, node: str) -> Permissions:
    """What the agent of `node` may publish and subscribe to (see the module doc)."""
    check_token(node, "node name")
    return {
        "publish": {
            "allow": [
                names.node_heartbeat(node),
                names.node_status_subjects(node),
                names.node_artifact_subjects(node),
                *object_read_subjects(names.datasets_bucket),
                # A resumed job's checkpoint or adapter, read as datasets are
                # (message and direct gets only: nothing that writes, purges or deletes).
                *object_read_subjects(names.artifacts_bucket),
            ]
        },
        "subscribe": {
            "allow": [
                names.node_start(node),
                names.node_cancel(node),
                names.node_checkpoint(node),
                names.node_serve(node),
                names.node_unserve(node),
                f"{node_inbox_prefix(node)}.>",
            ]
        },
        "allow_responses": True,
    }


# --- one identity per service and client (nkeys) ------------------------------

#: The services that get an identity of their own, in start order.
SERVICES = ("recorder", "scheduler", "artifact-store", "gateway")

#: Which service creates (and updates) which JetStream piece at its start
#: (bus.Layout's part names); no other identity may.
LAYOUT_OWNERS: dict[str, tuple[str, ...]] = {
    "recorder": ("status_stream", "datasets_store"),
    "scheduler": ("nodes_kv", "leader_kv", "node_marks_kv"),
    "artifact-store": ("artifacts_stream", "artifacts_store"),
    "gateway": ("gateway_kv",),
}


def owned_layout_parts(nats_nkey_seed: str | None, service: str) -> tuple[str, ...] | None:
    """The layout parts `service` ensures at its start (bus.ensure_layout's
    `parts`): with an identity of its own (an nkey seed) only what it owns,
    since it may not create the others'; with a shared user or none, every
    part (None), so that any start order works on a fresh server."""
    if not nats_nkey_seed or service not in LAYOUT_OWNERS:
        return None
    return LAYOUT_OWNERS[service]


def identity_inbox_prefix(kind: str, name: str) -> str:
    """The reply inbox prefix of an identity: a node's `_INBOX_<node>`, a
    service's `_INBOX.service.<name>`, a client's `_INBOX.client.<name>`.
    Distinct first tokens, so no node name can reach a service's replies."""
    if kind == "node":
        return node_inbox_prefix(name)
    if kind not in ("service", "client"):
        raise PermissionsError(f"identity kind {kind!r}: use node, service or client")
    return f"{DEFAULT_INBOX}.{kind}.{check_token(name, f'{kind} name')}"


def _stream_owner(stream: str) -> list[str]:
    """Creating, updating and reading the config of `stream` (ensure_layout)."""
    return [js_api_subject("STREAM", verb, stream) for verb in ("CREATE", "UPDATE", "INFO")]


def _durable(stream: str, durable: str) -> list[str]:
    """Pulling from, and acking on, one durable consumer (lorafleet.nats._consumer)."""
    return [
        js_api_subject("CONSUMER", "CREATE", stream, durable),
        js_api_subject("CONSUMER", "CREATE", stream, durable, ">"),
        js_api_subject("CONSUMER", "DURABLE", "CREATE", stream, durable),
        js_api_subject("CONSUMER", "INFO", stream, durable),
        js_api_subject("CONSUMER", "DELETE", stream, durable),
        js_api_subject("CONSUMER", "MSG", "NEXT", stream, durable),
        js_ack_subjects(stream, durable),
    ]


def _every_consumer(stream: str) -> list[str]:
    """Any consumer on `stream`, made, pulled, acked and deleted: the stream's
    owner reads deliveries back with short-lived pull consumers (the artifact-store)."""
    return [
        js_api_subject("CONSUMER", "CREATE", stream, ">"),
        js_api_subject("CONSUMER", "CREATE", stream),
        js_api_subject("CONSUMER", "DURABLE", "CREATE", stream, ">"),
        js_api_subject("CONSUMER", "INFO", stream, ">"),
        js_api_subject("CONSUMER", "DELETE", stream, ">"),
        js_api_subject("CONSUMER", "MSG", "NEXT", stream, ">"),
        js_ack_subjects(stream, "*"),  # any consumer of it
        js_api_subject("STREAM", "NAMES"),
    ]


def _reader(stream: str) -> list[str]:
    """Reading `stream` through ephemeral ordered consumers (a KV watch, an
    object get) and message gets: nothing that changes it."""
    return [
        js_api_subject("STREAM", "INFO", stream),
        js_api_subject("CONSUMER", "CREATE", stream),
        js_api_subject("CONSUMER", "CREATE", stream, "*", ">"),
        js_api_subject("CONSUMER", "INFO", stream, "*"),
        # nats-py's subscribe looks the stream up by subject; it lists names only.
        js_api_subject("STREAM", "NAMES"),
        js_api_subject("STREAM", "MSG", "GET", stream),
        js_api_subject("DIRECT", "GET", stream),
        js_api_subject("DIRECT", "GET", stream, ">"),
        js_flow_control_subjects(stream),
    ]


def _block(publish: list[str], subscribe: list[str]) -> Permissions:
    return {
        "publish": {"allow": list(dict.fromkeys(publish))},
        "subscribe": {"allow": list(dict.fromkeys(subscribe))},
        "allow_responses": True,
    }


def _inbox(kind: str, name: str) -> str:
    return f"{identity_inbox_prefix(kind, name)}.>"


def recorder_permissions(names: Names) -> Permissions:
    """The recorder's block (see the module doc)."""
    p, status, datasets = names.prefix, names.status_stream, object_stream(names.datasets_bucket)
    return _block(
        [
            f"{p}.events.jobs.*",
            *_stream_owner(status),
            *_durable(status, names.recorder_consumer),
            *_stream_owner(datasets),
            *_reader(datasets),
            js_api_subject("STREAM", "PURGE", datasets),
            object_subjects(names.datasets_bucket),
            # Retention reads which datasets the gateway's files name.
            js_api_subject("INFO"),  # nats-py's key_value reads the account's limits
            *_reader(kv_stream(names.gateway_bucket)),
        ],
        [
            names.datasets_gc,
            *(
                names.api("jobs", verb)
                for verb in ("submit", "get", "list", "curve", "estimate", "resume", "delete")
            ),
            names.api("models", "*"),
            names.adapters_list,
            f"{p}.store.jobs.*",
            SERVICE_DISCOVERY_SUBJECTS,
            _inbox("service", "recorder"),
        ],
    )


def scheduler_permissions(names: Names) -> Permissions:
    """The scheduler's block (see the module doc)."""
    p = names.prefix
    nodes_kv, leader_kv = kv_stream(names.nodes_bucket), kv_stream(names.leader_bucket)
    marks_kv = kv_stream(names.node_marks_bucket)
    return _block(
        [
            names.jobs_get,
            names.jobs_list,
            names.models_list,
            names.adapters_list,
            names.store_transition,
            f"{p}.node.*.start",
            f"{p}.node.*.cancel",
            f"{p}.node.*.checkpoint",
            f"{p}.node.*.serve",
            f"{p}.node.*.unserve",
            js_api_subject("INFO"),  # nats-py's create_key_value reads the account's limits
            *_stream_owner(nodes_kv),
            *_reader(nodes_kv),
            *_stream_owner(leader_kv),
            *_reader(leader_kv),
            kv_subjects(names.leader_bucket),
            *_stream_owner(marks_kv),
            *_reader(marks_kv),
            kv_subjects(names.node_marks_bucket),
        ],
        [
            names.all_job_events,
            names.jobs_cancel,
            names.nodes_list,
            names.nodes_schedule,
            names.adapters_serve,
            names.adapters_unserve,
            SERVICE_DISCOVERY_SUBJECTS,
            _inbox("service", "scheduler"),
        ],
    )


def artifact_store_permissions(names: Names) -> Permissions:
    """The artifact-store's block (see the module doc)."""
    chunks, objects_ = names.artifacts_stream, object_stream(names.artifacts_bucket)
    return _block(
        [
            names.jobs_get,  # is the delivering node the job's? (the recorder says)
            # Retention: the artifacts' jobs, who starts from them, who serves them.
            names.jobs_list,
            names.models_list,
            names.adapters_list,
            names.store_artifact,
            *_stream_owner(chunks),
            *_every_consumer(chunks),
            js_api_subject("STREAM", "MSG", "GET", chunks),
            js_api_subject("STREAM", "PURGE", chunks),
            *_stream_owner(objects_),
            *_reader(objects_),
            js_api_subject("STREAM", "PURGE", objects_),
            object_subjects(names.artifacts_bucket),
        ],
        [
            names.api("artifacts", "*"),
            SERVICE_DISCOVERY_SUBJECTS,
            _inbox("service", "artifact-store"),
        ],
    )


def client_permissions(names: Names, client: str) -> Permissions:
    """An operator's or the CLI's block: the API, putting datasets (their
    chunks and info), reading artifacts, hearing job events; nothing internal."""
    p = names.prefix
    datasets, artifacts = names.datasets_bucket, names.artifacts_bucket
    return _block(
        [
            f"{p}.api.>",
            object_chunk_subjects(datasets),
            object_meta_subjects(datasets),
            js_api_subject("STREAM", "INFO", object_stream(datasets)),
            *object_read_subjects(datasets),  # its own uploads, read back by the gateway
            *_reader(object_stream(artifacts)),
        ],
        [names.all_job_events, _inbox("client", client)],
    )


def gateway_permissions(names: Names) -> Permissions:
    """The gateway's block: a client's (which reads datasets back by message
    gets), on the gateway's own inboxes, owning its KV bucket, purging a
    refused upload's chunks from the datasets bucket."""
    client = client_permissions(names, "gateway")
    gateway_kv = kv_stream(names.gateway_bucket)
    return _block(
        [
            *client["publish"]["allow"],
            js_api_subject("STREAM", "PURGE", object_stream(names.datasets_bucket)),
            js_api_subject("INFO"),  # nats-py's create_key_value reads the account's limits
            *_stream_owner(gateway_kv),
            *_reader(gateway_kv),
            # The heartbeats, watched: a lost node leaves the routes at its expiry.
            *_reader(kv_stream(names.nodes_bucket)),
            kv_subjects(names.gateway_bucket),
        ],
        [
            *(s for s in client["subscribe"]["allow"] if s != _inbox("client", "gateway")),
            _inbox("service", "gateway"),
        ],
    )


def service_block(names: Names, service: str) -> Permissions:
    """The block of one of `SERVICES`."""
    makers = {
        "recorder": recorder_permissions,
        "scheduler": scheduler_permissions,
        "artifact-store": artifact_store_permissions,
        "gateway": gateway_permissions,
    }
    if service not in makers:
        raise PermissionsError(f"service {service!r}: use one of {', '.join(SERVICES)}")
    return makers[service](names)


def identity_block(names: Names, kind: str, name: str) -> Permissions:
    """The block of the identity `kind` ("node", "service", "client") `name`."""
    if kind == "node":
        return agent_permissions(names, name)
    if kind == "service":
        return service_block(names, name)
    if kind == "client":
        return client_permissions(names, check_token(name, "client name"))
    raise PermissionsError(f"identity kind {kind!r}: use node, service or client")


# --- checking a block (pure; for tests and operators) ---------------------------


def subject_matches(pattern: str, subject: str) -> bool:
    """True when NATS `pattern` (with `*` and `>` wildcards) matches `subject`."""
    pt, st = pattern.split("."), subject.split(".")
    for i, tok in enumerate(pt):
        if tok == ">":
            return len(st) > i
        if i >= len(st) or (tok != "*" and tok != st[i]):
            return False
    return len(pt) == len(st)


def allows(perms: Permissions, action: str, subject: str) -> bool:
    """True when `perms` let `action` ("publish" or "subscribe") on `subject`
    (allow lists only; a `deny` list wins where present). Replies through
    `allow_responses` are not subjects and are not judged here."""
    block = perms.get(action) or {}
    if any(subject_matches(d, subject) for d in block.get("deny", [])):
        return False
    return any(subject_matches(a, subject) for a in block.get("allow", []))
