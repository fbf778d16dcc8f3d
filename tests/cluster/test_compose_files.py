"""The compose files, as far as they can be checked without a container
engine: they parse, every lorafleet container runs a command the CLI has,
every LORAFLEET_* variable is a setting lorafleet reads, every file they
mount from the repository exists (or is one `lorafleet auth` writes), each
lorafleet container is given its own seed and no other, and the NATS cluster
is three members routed to each other from the one config
tests/cluster/test_compose.py boots as a real cluster."""

from __future__ import annotations

import dataclasses
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from lorafleet.access.permissions import identity_inbox_prefix
from lorafleet.settings import Settings
from lorafleet_services.agent.config import AgentConfig
from lorafleet_services.cli import app

COMPOSE = Path(__file__).resolve().parents[2] / "compose"
FILES = sorted(COMPOSE.glob("docker-compose*.yml"))
#: What compose mounts from `lorafleet auth --dir compose/identities` (not in the repository).
IDENTITIES = "./identities/"
#: The node name the GPU file's ${LORAFLEET_NODE} stands for here.
NODE = "gpu-1"


@pytest.fixture(scope="module")
def auth_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What the real `lorafleet auth` writes, as compose's header says to run it."""
    root = tmp_path_factory.mktemp("compose") / "identities"
    result = CliRunner().invoke(app, ["auth", "--dir", str(root), "--node", NODE])
    assert result.exit_code == 0, result.output
    return root


def mounted_path(source: str, auth_dir: Path) -> Path:
    """A compose file source, in the repository or in `lorafleet auth`'s output."""
    source = source.replace("${LORAFLEET_NODE}", NODE)
    if source.startswith(IDENTITIES):
        return auth_dir / source.removeprefix(IDENTITIES)
    return COMPOSE / source


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
def test_compose_names_only_what_lorafleet_defines(path: Path, auth_dir: Path) -> None:
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
                assert mounted_path(source, auth_dir).exists(), (
                    f"{path.name}: {name} mounts missing {source}"
                )
    for secret in doc.get("secrets", {}).values():
        assert mounted_path(secret["file"], auth_dir).exists(), f"{path.name}: {secret}"


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_each_container_gets_its_own_seed_and_no_other(path: Path) -> None:
    doc = yaml.safe_load(path.read_text())
    files = {name: s["file"] for name, s in doc.get("secrets", {}).items()}
    owners: dict[str, str] = {}
    for name, svc in lorafleet_services(doc).items():
        secrets = svc.get("secrets", [])
        assert len(secrets) == 1, f"{path.name}: {name} gets secrets {secrets}, not one seed"
        source = files[secrets[0]].replace("${LORAFLEET_NODE}", NODE)
        assert source.startswith(IDENTITIES), f"{path.name}: {name}'s seed is {source}"
        seed = PurePosixPath(source)
        kind, ident = seed.parent.name, seed.name.removesuffix(".nk")
        if kind == "service":
            assert ident == name, f"{path.name}: {name} runs with {kind}/{ident}'s seed"
        env = {k: str(v).replace("${LORAFLEET_NODE}", NODE) for k, v in svc["environment"].items()}
        assert env["LORAFLEET_NATS_NKEY_SEED"] == f"/run/secrets/{secrets[0]}", name
        assert env["LORAFLEET_NATS_INBOX_PREFIX"] == identity_inbox_prefix(kind, ident), name
        assert secrets[0] not in owners, f"{name} and {owners.get(secrets[0])} share a seed"
        owners[secrets[0]] = name


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
        # Beside it, as its `include ./authorization.conf` reads it.
        assert "./identities/authorization.conf:/etc/nats/authorization.conf:ro" in svc["volumes"]
    for name, svc in lorafleet_services(doc).items():
        env = svc["environment"]
        assert env["LORAFLEET_REPLICAS"] == "3", name
        assert sorted(env["LORAFLEET_NATS_URL"].split(",")) == [
            f"nats://{n}:4222" for n in sorted(members)
        ], name
    for twice in ("scheduler", "recorder"):
        assert doc["services"][twice]["deploy"]["replicas"] == 2, twice
