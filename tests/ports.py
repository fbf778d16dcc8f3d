"""A port for a server that cannot take a free one itself and say which
(Prometheus, PostgreSQL, vLLM), or for an address nothing listens on.

From this process's own block (lorafleet.nats.cluster.free_ports): no other
test worker or test run, and no port-0 bind anywhere, is given it, so it is
still free when the server binds it. Servers that can take port 0 and
report what they took (nats-server, the gateway, /metrics) are started so.
"""

from __future__ import annotations

from lorafleet.nats.cluster import free_ports

__all__ = ["free_port", "free_ports"]


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]
