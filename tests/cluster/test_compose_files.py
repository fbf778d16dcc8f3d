"""The compose files, as far as they can be checked without a container
engine: they parse, every lorafleet container runs a command the CLI has,
every LORAFLEET_* variable is a setting lorafleet reads, every file they
mount from the repository exists, and the NATS cluster is three members
routed to each other from the one config tests/cluster/test_compose.py
boots as a real cluster."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml

from lorafleet.settings import Settings
from lorafleet_services.agent.config import AgentConfig
from lorafleet_services.cli import app

COMPOSE = Path(__file__).resolve().parents[2] / "compose"
FILES = sorted(COMPOSE.glob("docker-compose*.yml"))


def settings_variables() -> set[str]:
    shared = {f"LORAFLEET_{f.name.upper()}" for f in dataclasses.fields(Settings)}
    agent = {f"LORAFLEET_AGENT_{f.name.upper()}" for f in dataclasses.fields(AgentConfig)}
    return shared | agent


def cli_commands() -> set[str]:
    import typer.main

    group = typer.main.get_group(app)
    return set(group.commands)


def lorafleet_services(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        name: svc
        for name, svc in doc["services"].items()
        if "compose/Dockerfile" in str(svc.get("build", ""))
    }


def test_there_are_compose_files() -> None:
    assert {f.name for f in FILES} >= {"docker-compose.yml", "docker-compose.gpu.yml"}


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_compose_names_only_what_lorafleet_defines(path: Path) -> None:
    doc = yaml.safe_load(path.read_text())
    ours = lorafleet_services(doc)
    assert ours, f"{path.name} runs no lorafleet container"
    known, commands = settings_variables(), cli_commands()
    for name, svc in ours.items():
        assert svc["command"][0] in commands, f"{path.name}: {name} runs {svc['command']}"
        unknown = {k for k in svc.get("environment", {}) if k.startswith("LORAFLEET_")} - known
        assert not unknown, f"{path.name}: {name} sets {unknown}, which lorafleet never reads"
    for name, svc in doc["services"].items():
        for volume in svc.get("volumes", []):
            source = str(volume).split(":")[0]
            if source.startswith("./"):
                assert (COMPOSE / source).exists(), f"{path.name}: {name} mounts missing {source}"


def test_the_control_plane_runs_on_three_routed_nats_servers() -> None:
    doc = yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())
    members = {n: s for n, s in doc["services"].items() if n.startswith("nats-")}
    assert sorted(members) == ["nats-1", "nats-2", "nats-3"]
    for name, svc in members.items():
        env = svc["environment"]
        routes = {env["NATS_ROUTE_A"], env["NATS_ROUTE_B"]}
        others = {f"nats-route://{n}:6222" for n in members if n != name}
        assert env["NATS_SERVER_NAME"] == name and routes == others
        assert "./nats-cluster/nats.conf:/etc/nats/nats.conf:ro" in svc["volumes"]
    for name, svc in lorafleet_services(doc).items():
        env = svc["environment"]
        assert env["LORAFLEET_REPLICAS"] == "3", name
        assert sorted(env["LORAFLEET_NATS_URL"].split(",")) == [
            f"nats://{n}:4222" for n in sorted(members)
        ], name
    schedulers = doc["services"]["scheduler"]["deploy"]["replicas"]
    assert schedulers == 2
