"""Partition tests: the agent runs in a network namespace of the test's own,
joined by one veth pair (tests/partition/netns.py); the nats-server listens
on the test's end of it, and the other services reach it there too (a
local address: the cut does not touch them). Skipped, saying why, where
namespaces cannot be created."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from lorafleet.nats.server import NatsServer
from tests.partition.netns import NetnsLink, available
from tests.system.conftest import stack, stack_settings  # noqa: F401 (fixtures; the server on the link)


@pytest.fixture(scope="session")
def netns_reason() -> str | None:
    return available()


@pytest.fixture
def link(netns_reason: str | None) -> Iterator[NetnsLink]:
    if netns_reason is not None:
        pytest.skip(netns_reason)
    made = NetnsLink().create()
    try:
        yield made
    finally:
        made.delete()


@pytest.fixture
async def nats_server(link: NetnsLink, tmp_path: Path) -> AsyncIterator[NatsServer]:
    server = NatsServer(tmp_path / "nats-store", host=link.host_ip)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()
