"""The compose files, as far as they can be checked without a container
engine: they parse, every lorafleet container runs a command the CLI has,
every LORAFLEET_* variable is a setting lorafleet reads, every file they
mount from the repository exists (or is one `lorafleet auth` writes), each
lorafleet container is given its own seed and no other, and the NATS cluster
is three members routed to each other from the one config
tests/cluster/test_compose.py boots as a real cluster."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from lorafleet.access.permissions import identity_inbox_prefix
from lorafleet.settings import Settings
from lorafleet_services.agent.config import AgentConfig
from lorafleet_services.cli import app
from lorafleet_services.gateway.config import GatewayConfig

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
    gateway = {f"LORAFLEET_GATEWAY_{f.name.upper()}" for f in dataclasses.fields(GatewayConfig)}
    return shared | agent | gateway


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


def published(svc: dict[str, Any], container_port: int) -> list[int]:
    """The host ports `svc` publishes `container_port` on."""
    ports = []
    for entry in svc.get("ports", []):
        host, _, inside = str(entry).rpartition(":")
        if int(inside) == container_port:
            ports.append(int(host.rpartition(":")[2]))
    return ports


def nats_members(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in doc["services"].items() if n.startswith("nats-")}


def test_every_nats_server_is_reachable_and_advertised_to_agents_on_other_hosts() -> None:
    """Each member publishes its own client port and advertises the host and
    that port: a remote client that loses one member moves to another."""
    conf = (COMPOSE / "nats-cluster" / "nats.conf").read_text()
    assert "\nclient_advertise: $NATS_CLIENT_ADVERTISE\n" in conf
    doc = yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())
    seen: set[int] = set()
    for name, svc in nats_members(doc).items():
        (port,) = published(svc, 4222) or [None]
        assert port is not None, f"{name} publishes no client port"
        assert port not in seen, f"{name} publishes client port {port} twice"
        seen.add(port)
        advertised = str(svc["environment"].get("NATS_CLIENT_ADVERTISE", ""))
        assert advertised.startswith("${LORAFLEET_PUBLIC_HOST"), (name, advertised)
        assert advertised.endswith(f"}}:{port}"), f"{name} advertises {advertised}, not :{port}"


def test_every_agent_example_is_given_the_three_servers() -> None:
    control_plane = yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())
    ports = sorted(p for svc in nats_members(control_plane).values() for p in published(svc, 4222))
    gpu = yaml.safe_load((COMPOSE / "docker-compose.gpu.yml").read_text())
    agents = {n: s for n, s in lorafleet_services(gpu).items() if s["command"][0] == "agent"}
    assert agents
    for name, svc in agents.items():
        urls = str(svc["environment"]["LORAFLEET_NATS_URL"]).split(",")
        assert len(urls) == len(ports), f"{name} is given {urls}, not the {len(ports)} servers"
        assert sorted(int(u.rpartition(":")[2]) for u in urls) == ports, (name, urls)
        assert "LORAFLEET_AGENT_ADVERTISE_HOST" in svc["environment"], name


def test_the_gateway_runs_on_its_identity_with_its_keys_on_a_volume_and_its_port_published(
    auth_dir: Path,
) -> None:
    doc = yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())
    gateway = doc["services"]["gateway"]
    assert gateway["command"] == ["gateway"]
    assert (auth_dir / "service" / "gateway.nk").exists()
    env = gateway["environment"]
    host, _, port = env["LORAFLEET_GATEWAY_ADDR"].rpartition(":")
    assert host == "0.0.0.0", "the gateway must listen beyond the container's loopback"
    assert published(gateway, int(port)), f"the gateway's port {port} is not published"
    keys = PurePosixPath(env["LORAFLEET_GATEWAY_API_KEYS_FILE"])
    named_volumes = set(doc["volumes"])
    mounts = [str(v).split(":")[:2] for v in gateway.get("volumes", [])]
    assert any(
        source in named_volumes and keys.is_relative_to(target) for source, target in mounts
    ), f"the keys file {keys} is on no named volume: {mounts}"


def with_defaults(text: str) -> str:
    """`${NAME:-default}` as compose reads it where NAME is unset."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", text)


def test_the_gpu_agent_sits_beside_the_hosts_engines() -> None:
    """The host's processes and network; the engines, the work directory the
    adapters are staged in and the weights cache at the host's own paths
    (a host vLLM is handed the agent's paths), the engines at
    agent/config.py's default; the trainer as the host's engines' user."""
    gpu = yaml.safe_load(with_defaults((COMPOSE / "docker-compose.gpu.yml").read_text()))
    defaults = AgentConfig(node=NODE)
    for name, svc in lorafleet_services(gpu).items():
        assert (svc.get("pid"), svc.get("network_mode")) == ("host", "host"), name
        assert "ports" not in svc, f"{name}: the host's network publishes nothing"
        env = svc["environment"]
        mounts = {t: (s, rest) for s, t, *rest in (str(v).split(":") for v in svc["volumes"])}
        engines = env["LORAFLEET_AGENT_ENGINES_DIR"]
        assert engines == str(defaults.engines_dir), f"{name}: engines at {engines}"
        for path in (engines, env["LORAFLEET_AGENT_WORK_DIR"], env["LORAFLEET_AGENT_HF_HOME"]):
            assert path in mounts, f"{name}: {path} is not mounted"
            source, _ = mounts[path]
            assert source == path, f"{name}: {path} is the host's {source}, not the same path"
        assert mounts[engines][1] == ["ro"], f"{name}: the engines are not read-only"
        assert env["LORAFLEET_AGENT_WORK_DIR"] == str(defaults.work_dir), name
        assert env["LORAFLEET_AGENT_RUN_AS"] == defaults.run_as, name
        # The engines' user is the host's: the container resolves its name there.
        assert mounts["/etc/passwd"] == ("/etc/passwd", ["ro"]), name
        assert mounts["/etc/group"] == ("/etc/group", ["ro"]), name
