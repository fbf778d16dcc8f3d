"""The older password form (`lorafleet nats-config`): one user shared by
every service and the CLI, allowed all of `<prefix>.>`, and one user per
node with the node's own block (`permissions.agent_permissions`, the same
block a node's nkey identity gets).

Why it is kept beside `lorafleet auth`'s nkeys: it is what a nats-server
that already authenticates its users by password can take without seed
files (an operator pastes `lorafleet nats-config --blocks` into a config of
their own), and tests/permissions/test_fleet.py and test_refusals.py run the
whole system on it, so the node's block is proved under both forms. Prefer
nkeys: with the shared user a stolen service credential opens every door
(docs/deploy.md). Remove this module with its command, its tests and
those docs when no installation needs it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

from lorafleet.access.permissions import (
    DEFAULT_INBOX,
    Permissions,
    PermissionsError,
    agent_permissions,
)
from lorafleet.names import (
    JS_ACK_SUBJECTS,
    JS_API_SUBJECTS,
    JS_FLOW_CONTROL_SUBJECTS,
    SERVICE_DISCOVERY_SUBJECTS,
    Names,
    check_token,
    kv_subjects,
    node_inbox_prefix,
    object_subjects,
)
from lorafleet.nats.config import config_header

#: The user name `fleet_users` gives the services.
SERVICE_USER = "lorafleet"


def service_permissions(names: Names) -> Permissions:
    """What the recorder, scheduler, artifact-store and gateway may do (see the module doc)."""
    p = names.prefix
    buckets_kv = [names.nodes_bucket, names.leader_bucket, names.gateway_bucket]
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
    lines = config_header("lorafleet nats-config", listen, store_dir, max_payload, None)
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
