"""The permission blocks, the server config and their helpers, without a bus
(except `nats-server -t`, which checks a config and exits)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from lorafleet.access.passwords import (
    SERVICE_USER,
    client_env,
    fleet_users,
    server_config,
    service_permissions,
)
from lorafleet.access.permissions import (
    PermissionsError,
    agent_permissions,
    allows,
    identity_block,
    subject_matches,
)
from lorafleet.names import InvalidNameError, Names, object_read_subjects
from lorafleet.nats._bus import redact_url
from lorafleet.nats._natspy import permissions_violation_message
from lorafleet.nats.server import binary
from lorafleet.settings import Settings, SettingsError

N = Names()


@pytest.mark.parametrize(
    ("pattern", "subject", "match"),
    [
        ("a.b", "a.b", True),
        ("a.*", "a.b", True),
        ("a.*", "a.b.c", False),
        ("a.>", "a.b.c", True),
        ("a.>", "a", False),
        ("a.b", "a.bc", False),
        ("a.*.c", "a.x.c", True),
        ("_INBOX_node-1.>", "_INBOX_node-10.x", False),
    ],
)
def test_subject_matches(pattern: str, subject: str, match: bool) -> None:
    assert subject_matches(pattern, subject) is match


def test_an_agent_may_do_its_own_nodes_work() -> None:
    p = agent_permissions(N, "node-1")
    for subject in (
        "$KV.lorafleet_nodes.node-1",
        N.status("node-1", "job-a"),
        N.artifact_chunks("node-1", "job-a", "peft"),
        "$JS.API.STREAM.MSG.GET.OBJ_lorafleet_datasets",
        "$JS.API.DIRECT.GET.OBJ_lorafleet_datasets",
        # A resumed job reads its checkpoint as it reads its dataset.
        *object_read_subjects(N.artifacts_bucket),
    ):
        assert allows(p, "publish", subject), subject
    assert allows(p, "publish", N.serving_report("node-1", "job-a"))
    for subject in (
        N.node_start("node-1"),
        N.node_cancel("node-1"),
        N.node_serve("node-1"),
        N.node_unserve("node-1"),
        "_INBOX_node-1.abc.1",
    ):
        assert allows(p, "subscribe", subject), subject
    assert p["allow_responses"] is True


@pytest.mark.parametrize("other", ["node-2", "node-10", "node"])
def test_an_agent_may_not_do_another_nodes_work(other: str) -> None:
    p = agent_permissions(N, "node-1")
    for subject in (
        f"$KV.lorafleet_nodes.{other}",
        N.status(other, "job-a"),
        N.artifact_chunks(other, "job-a", "peft"),
    ):
        assert not allows(p, "publish", subject), subject
    assert not allows(p, "publish", N.serving_report(other, "job-a"))
    for subject in (
        N.node_start(other),
        N.node_cancel(other),
        N.node_serve(other),
        N.node_unserve(other),
        f"_INBOX_{other}.x",
    ):
        assert not allows(p, "subscribe", subject), subject


def test_an_agent_may_not_touch_the_rest() -> None:
    p = agent_permissions(N, "node-1")
    for subject in (
        N.store_transition,
        N.store_artifact,
        N.jobs_submit,
        N.job_events("job-a"),
        "$JS.API.STREAM.CREATE.LORAFLEET_STATUS",
        "$JS.API.STREAM.INFO.OBJ_lorafleet_datasets",
        "$JS.API.CONSUMER.CREATE.OBJ_lorafleet_datasets",
        # The artifacts: read by message gets only, never changed.
        "$JS.API.STREAM.PURGE.OBJ_lorafleet_artifacts",
        "$JS.API.STREAM.MSG.DELETE.OBJ_lorafleet_artifacts",
        "$JS.API.STREAM.INFO.OBJ_lorafleet_artifacts",
        "$JS.API.CONSUMER.CREATE.OBJ_lorafleet_artifacts",
        "$O.lorafleet_artifacts.C.x",
        "$O.lorafleet_artifacts.M.x",
        "$KV.lorafleet_leader.leader",
        "$O.lorafleet_datasets.C.x",
        "_INBOX.x",
    ):
        assert not allows(p, "publish", subject), subject
    for subject in ("_INBOX.x.y", N.status("node-1", "job-a"), N.all_job_events, ">"):
        assert not allows(p, "subscribe", subject), subject


def test_the_blocks_follow_the_prefix() -> None:
    names = Names("acme")
    p = agent_permissions(names, "n1")
    assert allows(p, "publish", names.status("n1", "j"))
    assert allows(p, "publish", "$KV.acme_nodes.n1")
    assert not allows(p, "publish", N.status("n1", "j"))
    s = service_permissions(names)
    assert allows(s, "publish", names.store_transition)
    assert not allows(s, "publish", N.store_transition)


@pytest.mark.parametrize("node", ["a.b", "*", ">", "", "node 1"])
def test_a_node_name_that_is_no_token_is_refused(node: str) -> None:
    with pytest.raises(InvalidNameError):
        agent_permissions(N, node)


def test_the_services_may_do_what_they_do() -> None:
    s = service_permissions(N)
    for subject in (
        N.jobs_submit,
        N.store_transition,
        N.node_start("node-7"),
        N.job_events("j"),
        "$JS.API.STREAM.CREATE.LORAFLEET_STATUS",
        "$KV.lorafleet_leader.leader",
        "$O.lorafleet_artifacts.C.x",
        "_INBOX.abc",
    ):
        assert allows(s, "publish", subject), subject
    for subject in (N.status("n", "j"), N.artifact_chunks("n", "j", "peft"), "_INBOX.a.b"):
        assert allows(s, "subscribe", subject), subject
    assert not allows(s, "publish", "other.thing")


def test_the_config_is_one_nats_server_accepts(tmp_path: Path) -> None:
    users = fleet_users(N, ["node-1", "node-2"], {SERVICE_USER: "s", "node-1": "a", "node-2": "b"})
    assert set(users) == {SERVICE_USER, "node-1", "node-2"}
    text = server_config(users, listen="127.0.0.1:4222", store_dir=str(tmp_path / "js"))
    conf = tmp_path / "nats.conf"
    conf.write_text(text)
    done = subprocess.run(
        [binary(), "-t", "-c", str(conf)], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    assert "is valid" in done.stderr
    # A broken config is refused by the same check (the check can fail).
    conf.write_text(text.replace("authorization {", "authorization {{"))
    bad = subprocess.run(
        [binary(), "-t", "-c", str(conf)], capture_output=True, text=True, timeout=30
    )
    assert bad.returncode != 0


@pytest.mark.parametrize(("user", "password"), [("a b", "x"), ("a", 'x"y'), ("a", ""), ("", "x")])
def test_a_user_or_password_that_cannot_be_written_is_refused(user: str, password: str) -> None:
    with pytest.raises(PermissionsError):
        server_config({user: (password, agent_permissions(N, "n"))})


def test_a_node_may_not_share_the_service_users_name() -> None:
    with pytest.raises(PermissionsError):
        fleet_users(N, [SERVICE_USER], {SERVICE_USER: "x"})


def test_client_env_names_the_inbox_prefix_of_a_node() -> None:
    line = client_env("node-1", "pw", "10.0.0.1:4222", node="node-1")
    assert "LORAFLEET_NATS_URL=nats://node-1:pw@10.0.0.1:4222" in line
    assert "LORAFLEET_NATS_INBOX_PREFIX=_INBOX_node-1" in line
    assert "INBOX" not in client_env(SERVICE_USER, "pw", "h:1")


def test_the_inbox_prefix_setting() -> None:
    assert Settings().nats_inbox_prefix == "_INBOX"
    s = Settings.from_env({"LORAFLEET_NATS_INBOX_PREFIX": "_INBOX_node-1"})
    assert s.nats_inbox_prefix == "_INBOX_node-1"
    assert Settings.from_env(s.to_env()).nats_inbox_prefix == "_INBOX_node-1"
    for bad in ("", "a.*", "a.>", "a..b", "a b"):
        with pytest.raises(SettingsError, match="LORAFLEET_NATS_INBOX_PREFIX"):
            Settings(nats_inbox_prefix=bad)


def test_refusal_and_redaction() -> None:
    err = Exception('nats: permissions violation for publish to "$kv.b.k"')
    assert permissions_violation_message(err) == 'permissions violation for publish to "$kv.b.k"'
    assert permissions_violation_message(Exception("nats: stale connection")) is None
    assert redact_url("nats://u:p@h:1,nats://h2:2") == "nats://u:***@h:1,nats://h2:2"
    assert redact_url("nats://h:1") == "nats://h:1"


def test_the_serving_requests_go_from_the_scheduler_to_the_nodes_only() -> None:
    scheduler = identity_block(N, "service", "scheduler")
    recorder = identity_block(N, "service", "recorder")
    client = identity_block(N, "client", "cli")
    for subject in (N.node_serve("gpu-3"), N.node_unserve("gpu-3"), N.adapters_list):
        assert allows(scheduler, "publish", subject), subject
    for subject in (N.adapters_serve, N.adapters_unserve):
        assert allows(scheduler, "subscribe", subject) and allows(client, "publish", subject)
    assert allows(recorder, "subscribe", N.adapters_list)
    assert allows(client, "publish", N.adapters_list)
    for block in (recorder, client):
        assert not allows(block, "publish", N.node_serve("gpu-3")), block


def test_marks_are_the_scheduler_s_and_the_gateway_watches_the_heartbeats() -> None:
    scheduler = identity_block(N, "service", "scheduler")
    gateway = identity_block(N, "service", "gateway")
    agent = identity_block(N, "node", "gpu-3")
    client = identity_block(N, "client", "cli")
    marks = N.kv_subject(N.node_marks_bucket, "gpu-3")
    assert allows(scheduler, "publish", marks) and allows(scheduler, "subscribe", N.nodes_schedule)
    assert allows(client, "publish", N.nodes_schedule)
    for block in (agent, client, gateway):
        assert not allows(block, "publish", marks), block
    nodes_kv = f"$JS.API.CONSUMER.CREATE.KV_{N.nodes_bucket}"
    assert allows(gateway, "publish", nodes_kv)
    assert not allows(gateway, "publish", N.node_heartbeat("gpu-3"))
