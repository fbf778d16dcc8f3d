"""NATS for lorafleet: nats-server processes and their configs (public), and
the plumbing lorafleet's own services use on nats-py (modules named with a
leading `_`, which change without notice).

- server: one nats-server from the pinned wheel (`NatsServer`);
- cluster: three of them on one host (`NatsCluster`);
- config: a server config's text (TLS, nkey users, authorization);
- _bus: connections, requests, the JetStream layout;
- _consumer: the JetStream pull loop;
- _kv_watch: one KV watch that lasts;
- _publisher: messages published in order, each until acknowledged;
- _micro: NATS micro endpoints;
- _natspy: nats-py workarounds (publishes, objects, key-value reads).

The names below are imported on first use, so that importing one module
here does not import the others (nats and access import each other's modules).
"""

from __future__ import annotations

from lorafleet._lazy import lazy_exports

_HOME = {
    "NatsCluster": "cluster",
    "NatsServer": "server",
    "NatsServerError": "server",
    "ServerTls": "config",
    "nkey_server_config": "config",
}

__all__ = sorted(_HOME)

__getattr__ = lazy_exports(__name__, _HOME)
