"""The agent's systemd unit in docs/deploy.md, read from the page itself.

What the agent runs with is the environment systemd builds: `Environment=`
lines first, then each `EnvironmentFile=` in order, a later file's variable
replacing an earlier one's and any file's replacing `Environment=`'s
(systemd.exec(5)). The shared file is what the real `lorafleet auth` writes
for the node; the node's own file is the page's block that names its path.
Where `systemd-analyze` is installed it verifies the unit too (its
ExecStart pointed at this venv's `lorafleet`: verify wants the program).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lorafleet_services.cli import app

DOC = Path(__file__).resolve().parents[2] / "docs" / "deploy.md"
NODE = "gpu-3"
#: Where "Nodes, beside their engines" step 2 copies the node's seed.
SEED_ON_NODE = "/etc/lorafleet/node.nk"
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def code_blocks(text: str) -> list[str]:
    """Every fenced block's text, its indentation removed."""
    blocks = []
    for match in re.finditer(r"^( *)```\w*\n(.*?)^\1```", text, re.M | re.S):
        indent = len(match.group(1))
        blocks.append("\n".join(line[indent:] for line in match.group(2).splitlines()))
    return blocks


def unit_text() -> str:
    (unit,) = [b for b in code_blocks(DOC.read_text()) if "lorafleet agent --node" in b]
    return unit


def unit_settings(unit: str, key: str) -> list[str]:
    return [line.split("=", 1)[1] for line in unit.splitlines() if line.startswith(f"{key}=")]


def env_lines(text: str) -> dict[str, str]:
    pairs = (line.split("=", 1) for line in text.splitlines() if "=" in line)
    return {k.strip(): v.strip() for k, v in pairs if not k.lstrip().startswith("#")}


def environment_files(auth_dir: Path) -> dict[str, str]:
    """Each env file's text by its path on the node: `lorafleet auth`'s for
    the node, and every block of the page whose first line names a path."""
    files = {f"/etc/lorafleet/node-{NODE}.env": (auth_dir / "env" / f"node-{NODE}.env").read_text()}
    for block in code_blocks(DOC.read_text()):
        first = block.splitlines()[0] if block else ""
        if re.fullmatch(r"# /\S+\.env", first):
            files[first.removeprefix("# ")] = block
    return files


def systemd_environment(unit: str, files: dict[str, str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for assignment in unit_settings(unit, "Environment"):
        env.update(env_lines(assignment))
    for path in unit_settings(unit, "EnvironmentFile"):
        assert path.lstrip("-") in files, f"the unit reads {path}, which the page never gives"
        env.update(env_lines(files[path.lstrip("-")]))
    return env


def test_the_agent_runs_with_the_nodes_own_seed_and_advertised_host(tmp_path: Path) -> None:
    made = CliRunner().invoke(app, ["auth", "--dir", str(tmp_path / "ids"), "--node", NODE])
    assert made.exit_code == 0, made.output
    assert f"to `{SEED_ON_NODE}`" in DOC.read_text(), "step 2 copies the seed elsewhere now"
    env = systemd_environment(unit_text(), environment_files(tmp_path / "ids"))
    assert env["LORAFLEET_NATS_NKEY_SEED"] == SEED_ON_NODE, (
        f"systemd gives the agent the seed at {env['LORAFLEET_NATS_NKEY_SEED']}"
    )
    assert env["LORAFLEET_AGENT_NODE"] == NODE
    host = env.get("LORAFLEET_AGENT_ADVERTISE_HOST")
    assert host and host not in LOOPBACK, f"the node advertises {host!r}"


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="no systemd-analyze here")
def test_systemd_analyze_verifies_the_unit(tmp_path: Path) -> None:
    unit = unit_text()
    (program,) = {s.split()[0] for s in unit_settings(unit, "ExecStart")}
    here = Path(sys.executable).parent / "lorafleet"
    path = tmp_path / "lorafleet-agent.service"
    path.write_text(unit.replace(program, str(here)) + "\n")
    done = subprocess.run(
        ["systemd-analyze", "verify", str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and not done.stderr.strip(), done.stdout + done.stderr
