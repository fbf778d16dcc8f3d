from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest

from lorafleet.names import (
    InvalidNameError,
    Names,
    chunk_msg_id,
    serving_msg_id,
    status_msg_id,
)
from lorafleet.settings import Settings, SettingsError, read_env, write_env
from lorafleet_services.agent.config import AgentConfig, AgentConfigError


def test_settings_round_trip_through_the_environment() -> None:
    s = Settings(nats_url="nats://127.0.0.1:1234", heartbeat_s=0.5, node_timeout_s=4)
    assert Settings.from_env(s.to_env()) == s


def test_settings_errors_say_what_to_change() -> None:
    with pytest.raises(SettingsError, match="LORAFLEET_NODE_TIMEOUT_S"):
        Settings.from_env({"LORAFLEET_NODE_TIMEOUT_S": "soon"})
    with pytest.raises(SettingsError, match="must exceed"):
        Settings(heartbeat_s=3, node_timeout_s=3)


def test_the_two_knobs_that_bypassed_settings_are_settings() -> None:
    s = Settings.from_env(
        {"LORAFLEET_RECORDER_ACK_WAIT_S": "2", "LORAFLEET_ARTIFACT_ORPHAN_AGE_S": "0"}
    )
    assert s.recorder_ack_wait_s == 2.0 and s.artifact_orphan_age_s == 0.0
    assert Settings.from_env(s.to_env()) == s
    assert Settings().recorder_ack_wait_s == 10.0 and Settings().artifact_orphan_age_s == 600.0
    with pytest.raises(SettingsError, match="LORAFLEET_RECORDER_ACK_WAIT_S='soon' is not a number"):
        Settings.from_env({"LORAFLEET_RECORDER_ACK_WAIT_S": "soon"})
    with pytest.raises(SettingsError, match="LORAFLEET_RECORDER_ACK_WAIT_S must be > 0"):
        Settings.from_env({"LORAFLEET_RECORDER_ACK_WAIT_S": "0"})
    with pytest.raises(SettingsError, match="LORAFLEET_ARTIFACT_ORPHAN_AGE_S must be >= 0"):
        Settings.from_env({"LORAFLEET_ARTIFACT_ORPHAN_AGE_S": "-1"})


def test_retention_settings_are_seconds_and_zero_is_off() -> None:
    s = Settings.from_env({"LORAFLEET_RETENTION_CHECKPOINT_AFTER_S": "0",
                           "LORAFLEET_RETENTION_GRACE_S": "5"})  # fmt: skip
    assert (s.retention_checkpoint_after_s, s.retention_grace_s) == (0.0, 5.0)
    d = Settings()
    assert (d.retention_checkpoint_after_s, d.retention_adapter_after_s) == (14 * 86400.0, 0.0)
    assert (d.retention_dataset_after_s, d.retention_sweep_every_s) == (0.0, 3600.0)
    for name in ("SWEEP_EVERY", "GRACE", "CHECKPOINT_AFTER", "ADAPTER_AFTER", "DATASET_AFTER"):
        with pytest.raises(SettingsError, match=f"LORAFLEET_RETENTION_{name}_S must be >= 0"):
            Settings.from_env({f"LORAFLEET_RETENTION_{name}_S": "-1"})


def test_a_bad_value_names_the_variable_what_to_set_and_the_default() -> None:
    with pytest.raises(SettingsError) as e:
        Settings.from_env({"LORAFLEET_NODE_TIMEOUT_S": "soon"})
    assert str(e.value) == (
        "LORAFLEET_NODE_TIMEOUT_S='soon' is not a whole number: "
        "set a whole number, or unset it (default 3)"
    )


@dataclass(frozen=True)
class Knobs:
    flag: bool = False
    path: Path = Path("/x")
    maybe: str | None = "set"
    words: tuple[str, ...] = ()
    count: int = 1


class StructKnobs(msgspec.Struct, frozen=True):
    flag: bool = False
    count: int = 1


@pytest.mark.parametrize(
    ("raw", "want"),
    [("1", True), ("TRUE", True), ("yes", True), ("on", True), ("0", False), ("off", False),
     ("no", False), ("", False)],
)  # fmt: skip
def test_bool_words(raw: str, want: bool) -> None:
    assert read_env(Knobs, "K_", {"K_FLAG": raw}) == {"flag": want}


def test_each_field_is_decoded_to_its_annotated_type() -> None:
    env = {"K_PATH": "/a/b", "K_MAYBE": "", "K_WORDS": "a, b,,c ", "K_COUNT": "7"}
    got = read_env(Knobs, "K_", env)
    assert got == {"path": Path("/a/b"), "maybe": None, "words": ("a", "b", "c"), "count": 7}
    assert type(got["path"]) is type(Path("/a/b"))
    knobs = Knobs(**{**got, "maybe": "m"})
    assert Knobs(**read_env(Knobs, "K_", write_env(knobs, "K_"))) == knobs
    assert read_env(StructKnobs, "S_", {"S_FLAG": "on", "S_COUNT": "2"}) == {
        "flag": True,
        "count": 2,
    }
    with pytest.raises(SettingsError, match=r"K_FLAG='maybe' is not a bool \(1/true"):
        read_env(Knobs, "K_", {"K_FLAG": "maybe"})
    with pytest.raises(ValueError, match="K_COUNT"):
        read_env(Knobs, "K_", {"K_COUNT": "many"}, ValueError)


def test_names_derive_from_one_prefix() -> None:
    n = Names("acme")
    assert n.jobs_submit == "acme.api.jobs.submit"
    assert n.node_start("gpu-3") == "acme.node.gpu-3.start"
    assert n.status("gpu-3", "j1") == "acme.status.gpu-3.j1"
    assert n.nodes_bucket == "acme_nodes"
    assert n.status_stream == "ACME_STATUS"


def test_an_artifact_chunk_subject_is_taken_apart_where_it_is_built() -> None:
    n = Names("acme")
    assert n.artifact_chunks_parts(n.artifact_chunks("gpu-3", "j1", "gguf")) == (
        "gpu-3",
        "j1",
        "gguf",
    )
    for bad in (
        "lorafleet.artifacts.gpu-3.j1.gguf",  # another prefix's
        "acme.artifacts.gpu-3.j1",
        "acme.artifacts.gpu-3.j1.gguf.x",
        "acme.artifacts.gpu-3..gguf",
        "acme.status.gpu-3.j1",
    ):
        with pytest.raises(InvalidNameError, match=r"acme\.artifacts\.<node>\.<job>\.<kind>"):
            n.artifact_chunks_parts(bad)


def test_message_ids_of_different_messages_differ() -> None:
    """One stream stores a message whose id it has seen once: the status
    stream holds both status and serving reports, the artifact stream a job's
    checkpoints of one attempt; none of them may share an id."""
    status = {status_msg_id("n1", attempt, seq) for attempt in (1, 2) for seq in (1, 2)}
    serving = {serving_msg_id("n1", seq) for seq in (1, 2)}
    assert len(status) == 4 and len(serving) == 2 and not status & serving
    assert status_msg_id("j1", 2, 7) == "j1.2.7", "the id of the reports already stored"
    chunks = {
        chunk_msg_id("j1", kind, 1, seq, step)
        for kind, step in (("peft", None), ("checkpoint", 5), ("checkpoint", 50))
        for seq in (0, 1)
    }
    assert len(chunks) == 6


@pytest.mark.parametrize("bad", ["a.b", "a b", "*", ">", "", "a\n"])
def test_node_names_that_would_break_subjects_are_refused(bad: str) -> None:
    with pytest.raises(InvalidNameError, match="NATS subject"):
        Names().node_start(bad)
    with pytest.raises(InvalidNameError):
        Names(bad)


def test_agent_config_round_trips_through_the_environment(tmp_path: Path) -> None:
    cfg = AgentConfig(node="n1", work_dir=tmp_path, allow_cpu=True, run_as="", python=None)
    assert AgentConfig.from_env(cfg.to_env()) == cfg
    with pytest.raises(AgentConfigError, match="LORAFLEET_AGENT_CANCEL_GRACE_S"):
        AgentConfig.from_env({"LORAFLEET_AGENT_NODE": "n", "LORAFLEET_AGENT_CANCEL_GRACE_S": "x"})
    with pytest.raises(AgentConfigError, match="node name"):
        AgentConfig.from_env({})
