"""NATS permissions for lorafleet: what a node's agent and the services may do.

The blocks are nats-server's own shape (`{"publish": {"allow": [...]},
"subscribe": {"allow": [...]}, "allow_responses": true}`), usable in a
server config (`server_config`), an operator's JWT tooling, or read by a
person. Everything not allowed is denied.

An agent of node N may only:
- put its heartbeat: `$KV.<nodes bucket>.N` (a publish with a JetStream
  ack; the delete on a clean stop is a publish there too);
- publish its status reports and artifact chunks: `<prefix>.status.N.>`,
  `<prefix>.artifacts.N.>`;
- read datasets: `$JS.API.STREAM.MSG.GET.OBJ_<datasets bucket>`, the one
  JetStream API call `lorafleet.objects.read_object` makes
  (`names.msg_get_subject`);
- receive its own start and cancel requests, `<prefix>.node.N.{start,cancel}`,
  and answer them (`allow_responses`: one reply to each request received);
- receive replies on its own inboxes, `_INBOX_N.>` (the agent runs with
  LORAFLEET_NATS_INBOX_PREFIX=_INBOX_N), so it reads no one else's replies.

So it cannot put another node's heartbeat, status or artifacts, receive
another node's start or cancel, call the recorder's internal
`<prefix>.store.jobs.*`, create or change streams, or read the artifacts.

The services (recorder, scheduler, artifact-store) are trusted with the
installation: every subject under the prefix, the JetStream API (they
create the layout and consume the streams), the KV and object-store
subjects of lorafleet's buckets, micro service discovery (`$SRV.>`) and
the default inboxes. Clients (the `lorafleet` command) can use the service
user.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from lorafleet.names import (
    JS_ACK_SUBJECTS,
    JS_API_SUBJECTS,
    JS_FLOW_CONTROL_SUBJECTS,
    SERVICE_DISCOVERY_SUBJECTS,
    Names,
    check_token,
    kv_subjects,
    msg_get_subject,
    node_inbox_prefix,
    object_subjects,
)

#: A permission block as nats-server reads it.
Permissions = dict[str, Any]

#: The user name `fleet_users` gives the services.
SERVICE_USER = "lorafleet"

#: The inbox prefix of processes that keep nats-py's default.
DEFAULT_INBOX = "_INBOX"


class PermissionsError(ValueError):
    """A user name, password or listen address that cannot go into a server config."""


def agent_permissions(names: Names, node: str) -> Permissions:
    """What the agent of `node` may publish and subscribe to (see the module doc)."""
    check_token(node, "node name")
    return {
        "publish": {
            "allow": [
                names.node_heartbeat(node),
                names.node_status_subjects(node),
                names.node_artifact_subjects(node),
                msg_get_subject(names.datasets_bucket),
            ]
        },
        "subscribe": {
            "allow": [
                names.node_start(node),
                names.node_cancel(node),
                f"{node_inbox_prefix(node)}.>",
            ]
        },
        "allow_responses": True,
    }


def service_permissions(names: Names) -> Permissions:
    """What the recorder, scheduler and artifact-store may do (see the module doc)."""
    p = names.prefix
    buckets_kv = [names.nodes_bucket, names.leader_bucket]
    buckets_obj = [names.datasets_bucket, names.artifacts_bucket]
    return {
        "publish": {
            "allow": [
                f"{p}.>",
                JS_API_SUBJECTS,
                JS_ACK_SUBJECTS,
                JS_FLOW_CONTROL_SUBJECTS,
                *(kv_subjects(b) for b in buckets_kv),
                *(object_subjects(b) for b in buckets_obj),
                SERVICE_DISCOVERY_SUBJECTS,
                f"{DEFAULT_INBOX}.>",
            ]
        },
        "subscribe": {"allow": [f"{p}.>", SERVICE_DISCOVERY_SUBJECTS, f"{DEFAULT_INBOX}.>"]},
        "allow_responses": True,
    }


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


# --- a server config ----------------------------------------------------------


def _check_user(user: str, password: str) -> None:
    for what, value in (("user name", user), ("password", password)):
        if not value or any(c in value for c in '"\\\n\r\t ') or not value.isprintable():
            raise PermissionsError(
                f"{what} {value!r} cannot go into the server config: use printable "
                "characters without spaces, quotes or backslashes"
            )


def server_config(
    users: Mapping[str, tuple[str, Permissions]],
    *,
    listen: str | None = None,
    store_dir: str | None = None,
    max_payload: int | None = None,
) -> str:
    """A nats-server config with JetStream on and `users` (name -> (password,
    permissions)) in its `authorization` block.

    listen: "host:port" (default: nats-server's 0.0.0.0:4222, or the command
    line's -a/-p). store_dir: JetStream's store (default: nats-server's, or
    -sd). max_payload: bytes (default: nats-server's 1 MiB). Passwords are
    written as given: keep the file readable by the server's user only.
    """
    if not users:
        raise PermissionsError("a config needs at least one user")
    lines = ["# lorafleet: generated by `lorafleet nats-config`", ""]
    if listen is not None:
        lines.append(f"listen: {json.dumps(listen)}")
    if max_payload is not None:
        lines.append(f"max_payload: {int(max_payload)}")
    js = {"store_dir": store_dir} if store_dir else {}
    lines.append(f"jetstream: {json.dumps(js)}" if js else "jetstream: enabled")
    lines += ["", "authorization {", "  users = ["]
    for user, (password, perms) in users.items():
        _check_user(user, password)
        entry = {"user": user, "password": password, "permissions": perms}
        lines.append(f"    {json.dumps(entry)}")
    lines += ["  ]", "}", ""]
    return "\n".join(lines)


def fleet_users(
    names: Names,
    nodes: Iterable[str],
    passwords: Mapping[str, str],
    service_user: str = SERVICE_USER,
) -> dict[str, tuple[str, Permissions]]:
    """The users of one installation: `service_user` and one user per node
    (named as the node), each with the password `passwords` gives it."""
    users: dict[str, tuple[str, Permissions]] = {
        service_user: (passwords[service_user], service_permissions(names))
    }
    for node in nodes:
        if node == service_user:
            raise PermissionsError(f"node {node!r} has the service user's name; rename one")
        users[node] = (passwords[node], agent_permissions(names, node))
    return users


def client_env(user: str, password: str, host_port: str, node: str | None = None) -> str:
    """The LORAFLEET_* lines a process of `user` runs with (`node`: an agent's)."""
    out = f"LORAFLEET_NATS_URL=nats://{user}:{password}@{host_port}"
    if node is not None:
        out += f" LORAFLEET_NATS_INBOX_PREFIX={node_inbox_prefix(node)}"
        out += f" LORAFLEET_AGENT_NODE={check_token(node, 'node name')}"
    return out
