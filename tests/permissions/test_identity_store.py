"""The seed directory and `lorafleet auth`: seeds 0600, public keys only in the
config, re-running keeps every key, adding a node changes no other identity."""

from __future__ import annotations

import re
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lorafleet.access.identities import IdentityError, IdentityStore, ensure_fleet, process_env
from lorafleet.access.permissions import (
    LAYOUT_OWNERS,
    SERVICES,
    PermissionsError,
    allows,
    client_permissions,
    identity_block,
    identity_inbox_prefix,
    owned_layout_parts,
)
from lorafleet.names import Names
from lorafleet.settings import Settings, SettingsError
from lorafleet_services.cli import app

N = Names()


def seeds(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*.nk"))}


def test_seeds_are_0600_and_the_config_holds_public_keys_only(tmp_path: Path) -> None:
    out = CliRunner().invoke(app, ["auth", "--dir", str(tmp_path / "ids"), "--node", "gpu-1"])
    assert out.exit_code == 0, out.output
    root = tmp_path / "ids"
    made = seeds(root)
    assert set(made) == {
        "service/recorder.nk", "service/scheduler.nk", "service/artifact-store.nk",
        "service/gateway.nk", "client/cli.nk", "node/gpu-1.nk",
    }  # fmt: skip
    for rel in made:
        assert stat.S_IMODE((root / rel).stat().st_mode) == 0o600, rel
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    config = (root / "nats-server.conf").read_text()
    for seed in made.values():
        assert seed.strip().decode() not in config
    assert re.findall(r'"nkey": "(U[A-Z0-9]{55})"', config).__len__() == 6
    env = (root / "env" / "node-gpu-1.env").read_text()
    assert f"LORAFLEET_NATS_NKEY_SEED={root.resolve() / 'node' / 'gpu-1.nk'}" in env
    assert "LORAFLEET_NATS_INBOX_PREFIX=_INBOX_gpu-1" in env


def test_adding_a_node_later_changes_no_other_identity(tmp_path: Path) -> None:
    store = IdentityStore(tmp_path)
    first, made = ensure_fleet(store, ["gpu-1"])
    assert len(made) == len(first) == 6
    before = seeds(tmp_path)
    again, made = ensure_fleet(store, ["gpu-2"])
    assert [i.label for i in made] == ["node/gpu-2"]
    after = seeds(tmp_path)
    assert {k: v for k, v in after.items() if k != "node/gpu-2.nk"} == before
    # gpu-1 stays in the fleet although this run did not name it.
    assert {i.label for i in again} >= {"node/gpu-1", "node/gpu-2"}
    assert {i.public_key for i in first} <= {i.public_key for i in again}


def test_a_seed_others_can_read_or_a_damaged_one_is_refused(tmp_path: Path) -> None:
    store = IdentityStore(tmp_path)
    ensure_fleet(store, ["gpu-1"])
    path = store.seed_path("node", "gpu-1")
    path.chmod(0o644)
    with pytest.raises(IdentityError, match=r"readable by others \(mode 0644\).*chmod 600"):
        store.load("node", "gpu-1")
    path.chmod(0o600)
    path.write_text("not a seed\n")
    with pytest.raises(IdentityError, match="does not hold an nkey user seed"):
        store.load("node", "gpu-1")
    with pytest.raises(ValueError, match="cannot be part of a NATS subject"):
        ensure_fleet(store, ["gpu.1"])
    with pytest.raises(IdentityError, match="service 'mailer'"):
        store.ensure("service", "mailer")


def test_the_cli_says_what_it_kept_and_refuses_half_a_tls_pair(tmp_path: Path) -> None:
    args = ["auth", "--dir", str(tmp_path)]
    CliRunner().invoke(app, args)
    out = CliRunner().invoke(app, [*args, "--node", "gpu-9"])
    assert out.exit_code == 0, out.output
    assert re.search(r"^made\s+node/gpu-9 ", out.stdout, re.M)
    assert re.search(r"^kept\s+service/recorder ", out.stdout, re.M)
    bad = CliRunner().invoke(app, [*args, "--tls-cert", "c.pem"])
    assert bad.exit_code == 1
    assert "--tls-cert and --tls-key go together" in bad.output


def test_the_client_block_reaches_the_api_and_nothing_internal() -> None:
    c = client_permissions(N, "cli")
    assert allows(c, "publish", N.jobs_submit)
    assert allows(c, "publish", N.artifacts_get)
    assert allows(c, "subscribe", N.job_events("j1"))
    for subject in (
        N.store_transition,
        N.node_start("gpu-1"),
        N.node_heartbeat("gpu-1"),
        N.status("gpu-1", "j1"),
        "$O.lorafleet_artifacts.M.x",
        "$JS.API.STREAM.PURGE.OBJ_lorafleet_artifacts",
        "$JS.API.CONSUMER.MSG.NEXT.LORAFLEET_STATUS.recorder",
        "$JS.API.STREAM.DELETE.LORAFLEET_STATUS",
    ):
        assert not allows(c, "publish", subject), subject
    assert not allows(c, "subscribe", "_INBOX.service.recorder.x")


def test_each_service_creates_only_the_layout_it_owns() -> None:
    owned = [part for service in SERVICES for part in LAYOUT_OWNERS[service]]
    assert sorted(owned) == sorted(set(owned))  # one owner each
    assert len(owned) == 8
    assert owned_layout_parts(None, "recorder") is None  # no identity: everything
    assert owned_layout_parts("/s.nk", "recorder") == ("status_stream", "datasets_store")
    creators = {
        stream: [
            s for s in SERVICES
            if allows(identity_block(N, "service", s), "publish", f"$JS.API.STREAM.CREATE.{stream}")
        ]
        for stream in ("LORAFLEET_STATUS", "LORAFLEET_ARTIFACTS", "KV_lorafleet_nodes",
                       "KV_lorafleet_leader", "OBJ_lorafleet_datasets", "OBJ_lorafleet_artifacts",
                       "KV_lorafleet_gateway", "KV_lorafleet_node_marks")
    }  # fmt: skip
    assert creators == {
        "LORAFLEET_STATUS": ["recorder"],
        "LORAFLEET_ARTIFACTS": ["artifact-store"],
        "KV_lorafleet_nodes": ["scheduler"],
        "KV_lorafleet_leader": ["scheduler"],
        "OBJ_lorafleet_datasets": ["recorder"],
        "OBJ_lorafleet_artifacts": ["artifact-store"],
        "KV_lorafleet_gateway": ["gateway"],
        "KV_lorafleet_node_marks": ["scheduler"],
    }


def test_inboxes_are_apart() -> None:
    assert identity_inbox_prefix("node", "svc") == "_INBOX_svc"
    assert identity_inbox_prefix("service", "recorder") == "_INBOX.service.recorder"
    assert identity_inbox_prefix("client", "alice") == "_INBOX.client.alice"
    with pytest.raises(PermissionsError):
        identity_inbox_prefix("admin", "x")
    # A node named like a service cannot reach the service's replies.
    svc_node = identity_block(N, "node", "service")
    assert not allows(svc_node, "subscribe", "_INBOX.service.recorder.abc")


def test_process_env_for_a_node(tmp_path: Path) -> None:
    store = IdentityStore(tmp_path)
    ident, _ = store.ensure("node", "gpu-1")
    env = process_env(ident, "tls://nats:4222")
    assert env["LORAFLEET_AGENT_NODE"] == "gpu-1"
    assert env["LORAFLEET_NATS_URL"] == "tls://nats:4222"


def test_auth_with_tls_writes_the_tls_block_and_the_ca_into_each_env(tmp_path: Path) -> None:
    root = tmp_path / "ids"
    tls = ["--tls-cert", "/etc/nats/s.pem", "--tls-key", "/etc/nats/s.key"]
    args = ["auth", "--dir", str(root), "--url", "tls://nats:4222", *tls]
    out = CliRunner().invoke(app, [*args, "--tls-ca", "/etc/ca.pem", "--verify-clients"])
    assert out.exit_code == 0, out.output
    config = (root / "nats-server.conf").read_text()
    assert (
        'tls: {"cert_file": "/etc/nats/s.pem", "key_file": "/etc/nats/s.key", '
        '"ca_file": "/etc/ca.pem", "verify": true}'
    ) in config
    env = (root / "env" / "service-recorder.env").read_text()
    assert "LORAFLEET_NATS_URL=tls://nats:4222" in env
    assert "LORAFLEET_NATS_TLS_CA=/etc/ca.pem" in env
    bad = CliRunner().invoke(app, ["auth", "--dir", str(root), "--verify-clients"])
    assert bad.exit_code == 1
    assert "--verify-clients needs TLS" in bad.output
    no_ca = CliRunner().invoke(app, [*args, "--verify-clients"])
    assert no_ca.exit_code == 1
    assert "needs the CA that signs them" in no_ca.output


def test_tls_and_seed_settings_read_from_the_environment() -> None:
    s = Settings.from_env({"LORAFLEET_NATS_NKEY_SEED": "/s.nk", "LORAFLEET_NATS_TLS_CA": "/ca.pem"})
    assert (s.nats_nkey_seed, s.nats_tls_ca, s.nats_tls_cert) == ("/s.nk", "/ca.pem", None)
    with pytest.raises(SettingsError, match="LORAFLEET_NATS_TLS_CERT and LORAFLEET_NATS_TLS_KEY"):
        Settings.from_env({"LORAFLEET_NATS_TLS_CERT": "/c.pem"})
