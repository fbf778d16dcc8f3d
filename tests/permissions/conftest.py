"""Permission tests: a real nats-server with lorafleet's users and permissions
(lorafleet.access.passwords.server_config), services and agents as real processes
logging in as those users."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from lorafleet.access.identities import IdentityStore, ensure_fleet
from lorafleet.access.identities import server_config as identities_config
from lorafleet.access.passwords import SERVICE_USER, fleet_users, server_config
from lorafleet.names import Names, node_inbox_prefix
from lorafleet.nats.config import ServerTls
from lorafleet.nats.server import NatsServer
from lorafleet.settings import Settings
from tests.permissions.certs import Certs, make_certs

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


# --- nkey identities (lorafleet auth) -------------------------------------------


@dataclass
class IdentityFleet:
    """A nats-server run from `lorafleet auth`'s config: one nkey per service,
    client and node; `tls` when it speaks TLS only (clients checked by its CA)."""

    server: NatsServer
    store: IdentityStore
    base: Settings
    certs: Certs | None = None
    #: Every URL the processes get (a cluster's members); default: `server`'s.
    urls: str | None = None

    @property
    def url(self) -> str:
        if self.urls is not None:
            return self.urls
        scheme = "tls" if self.certs else "nats"
        return f"{scheme}://{self.server.host}:{self.server.port}"

    def settings_for(self, kind: str, name: str) -> Settings:
        """What the process of identity `kind`/`name` runs with: its seed and inboxes."""
        ident = self.store.load(kind, name)
        settings = self.base.with_(
            nats_url=self.url,
            nats_nkey_seed=str(ident.seed_file),
            nats_inbox_prefix=ident.inbox_prefix,
        )
        if self.certs is not None:
            settings = settings.with_(
                nats_tls_ca=str(self.certs.ca),
                nats_tls_cert=str(self.certs.client_cert),
                nats_tls_key=str(self.certs.client_key),
            )
        return settings

    def server_refusals(self) -> list[str]:
        """The server's own log lines of refused publishes and subscriptions."""
        return [line for line in self.server.output if "Violation" in line]


async def start_identity_fleet(tmp_path: Path, *, tls: bool = False) -> IdentityFleet:
    store = IdentityStore(tmp_path / "identities")
    identities, _made = ensure_fleet(store, NODES)
    certs = make_certs(tmp_path / "certs") if tls else None
    server_tls = (
        ServerTls(str(certs.server_cert), str(certs.server_key), str(certs.ca), True)
        if certs
        else None
    )
    conf = tmp_path / "nats.conf"
    conf.write_text(identities_config(Names(), identities, tls=server_tls))
    server = NatsServer(tmp_path / "nats-store", config_file=conf)
    await server.start()
    return IdentityFleet(server, store, identity_settings(tmp_path), certs)


def identity_settings(tmp_path: Path, **changes: Any) -> Settings:
    """What every process of an identity fleet shares (`settings_for` adds its own)."""
    return Settings(
        data_dir=str(tmp_path / "data"),
        database_url=f"sqlite+aiosqlite:///{tmp_path / 'lorafleet.db'}",
        heartbeat_s=0.5,
        node_timeout_s=3,
        request_timeout_s=3.0,
    ).with_(**changes)


@pytest.fixture
async def id_fleet(tmp_path: Path) -> AsyncIterator[IdentityFleet]:
    fleet = await start_identity_fleet(tmp_path)
    try:
        yield fleet
    finally:
        await fleet.server.stop()
