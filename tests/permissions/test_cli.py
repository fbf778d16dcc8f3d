"""`lorafleet nats-config`: the config it prints runs a nats-server whose users
are the ones its comment lines name, with the permissions the library gives."""

from __future__ import annotations

import json
import re
from pathlib import Path

import nats.errors
import pytest
from typer.testing import CliRunner

from lorafleet.access.passwords import SERVICE_USER, service_permissions
from lorafleet.access.permissions import agent_permissions
from lorafleet.errors import ConnectError
from lorafleet.names import Names
from lorafleet.nats import _bus as bus
from lorafleet.nats.server import NatsServer
from lorafleet.settings import Settings
from lorafleet_services.cli import app

_LINE = re.compile(r"^#   (\S+): LORAFLEET_NATS_URL=nats://([^:]+):(\S+)@h:1(.*)$")


async def test_the_printed_config_runs_a_server_with_those_users(tmp_path: Path) -> None:
    out = CliRunner().invoke(app, ["nats-config", "--node", "node-1", "--url", "h:1"])
    assert out.exit_code == 0, out.output
    creds = {m[1]: (m[3], m[4]) for ln in out.output.splitlines() if (m := _LINE.match(ln))}
    assert set(creds) == {SERVICE_USER, "node-1"}
    assert "LORAFLEET_NATS_INBOX_PREFIX=_INBOX_node-1" in creds["node-1"][1]
    conf = tmp_path / "nats.conf"
    conf.write_text(out.output)
    async with NatsServer(tmp_path / "store", config_file=conf) as server:
        node = Settings(
            nats_url=server.url_for("node-1", creds["node-1"][0]),
            nats_inbox_prefix="_INBOX_node-1",
        )
        refusals: list[str] = []
        nc = await bus.connect(node, "node-1", on_refused=refusals.append)
        try:
            await nc.publish(Names().node_heartbeat("node-2"), b"x")
            await nc.flush()
            with pytest.raises(nats.errors.TimeoutError):
                await nc.request(Names().store_transition, b"{}", timeout=0.3)
        finally:
            await bus.drain_quietly(nc)
        assert len(refusals) == 2, refusals
        wrong = node.with_(nats_url=server.url_for("node-1", "wrong"), connect_timeout_s=1.0)
        with pytest.raises(ConnectError, match="Authorization Violation"):
            await bus.connect(wrong, "node-1")


def test_blocks_prints_the_librarys_blocks() -> None:
    out = CliRunner().invoke(app, ["nats-config", "--node", "a", "--node", "b", "--blocks"])
    assert out.exit_code == 0, out.output
    got = json.loads(out.output)
    assert got == {
        SERVICE_USER: service_permissions(Names()),
        "a": agent_permissions(Names(), "a"),
        "b": agent_permissions(Names(), "b"),
    }


def test_a_bad_node_name_is_an_error_saying_what_to_use() -> None:
    out = CliRunner().invoke(app, ["nats-config", "--node", "gpu.1"])
    assert out.exit_code == 1
    assert "letters" in out.output
