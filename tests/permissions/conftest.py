"""Permission tests: a real nats-server with lorafleet's users and permissions
(lorafleet.permissions.server_config), services and agents as real processes
logging in as those users."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from lorafleet.names import Names, node_inbox_prefix
from lorafleet.natsserver import NatsServer
from lorafleet.permissions import SERVICE_USER, fleet_users, server_config
from lorafleet.settings import Settings

NODES = ("node-1", "node-2")


@dataclass
class Fleet:
    """A nats-server whose users are lorafleet's service user and one per node."""

    server: NatsServer
    passwords: dict[str, str]
    base: Settings

    def service_settings(self) -> Settings:
        url = self.server.url_for(SERVICE_USER, self.passwords[SERVICE_USER])
        return self.base.with_(nats_url=url)

    def node_settings(self, node: str) -> Settings:
        """What an agent of `node` runs with: its own user and inbox prefix."""
        return self.base.with_(
            nats_url=self.server.url_for(node, self.passwords[node]),
            nats_inbox_prefix=node_inbox_prefix(node),
        )


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[Fleet]:
    names = Names()
    passwords = {u: secrets.token_urlsafe(12) for u in (SERVICE_USER, *NODES)}
    conf = tmp_path / "nats.conf"
    conf.write_text(server_config(fleet_users(names, NODES, passwords)))
    server = NatsServer(tmp_path / "nats-store", config_file=conf)
    await server.start()
    base = Settings(
        nats_url=server.url,
        data_dir=str(tmp_path / "data"),
        database_url=f"sqlite+aiosqlite:///{tmp_path / 'lorafleet.db'}",
        heartbeat_s=0.5,
        node_timeout_s=3,
        request_timeout_s=3.0,
    )
    try:
        yield Fleet(server, passwords, base)
    finally:
        await server.stop()
