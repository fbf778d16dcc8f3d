from __future__ import annotations

from pathlib import Path

import pytest

from lorafleet.names import InvalidNameError, Names
from lorafleet.settings import Settings, SettingsError
from lorafleet_services.agent.config import AgentConfig, AgentConfigError


def test_settings_round_trip_through_the_environment() -> None:
    s = Settings(nats_url="nats://127.0.0.1:1234", heartbeat_s=0.5, node_timeout_s=4)
    assert Settings.from_env(s.to_env()) == s


def test_settings_errors_say_what_to_change() -> None:
    with pytest.raises(SettingsError, match="LORAFLEET_NODE_TIMEOUT_S"):
        Settings.from_env({"LORAFLEET_NODE_TIMEOUT_S": "soon"})
    with pytest.raises(SettingsError, match="must exceed"):
        Settings(heartbeat_s=3, node_timeout_s=3)


def test_names_derive_from_one_prefix() -> None:
    n = Names("acme")
    assert n.jobs_submit == "acme.api.jobs.submit"
    assert n.node_start("gpu-3") == "acme.node.gpu-3.start"
    assert n.status("gpu-3", "j1") == "acme.status.gpu-3.j1"
    assert n.nodes_bucket == "acme_nodes"
    assert n.status_stream == "ACME_STATUS"


@pytest.mark.parametrize("bad", ["a.b", "a b", "*", ">", ""])
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
