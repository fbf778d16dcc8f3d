"""The `lorafleet` command (every command and option: docs/cli.md).

One module per command group: services.py (the services, up, demo),
catalog.py, jobs.py (with follow.py: watching a job, plots.py: its plots),
nodes.py, top.py, serving.py, artifacts.py, auth.py (nkey identities),
nats_config.py (the older passwords); _app.py holds the Typer apps and what
they share (`show`: a view for a person, or JSON with --json; the JOB
argument; reading and writing the files a command names), exits.py the one
table of exit codes, _help.py tidies what --help shows. A new command goes
in its group's module.
"""

from __future__ import annotations

# Each module registers its commands on the shared apps when imported.
# Their order is --help's order of panels: services, jobs, fleet, the rest.
from lorafleet_services.cli import services

# isort: split
from lorafleet_services.cli import estimate, jobs, serving, top

# isort: split
from lorafleet_services.cli import artifacts, auth, catalog, nats_config, nodes
from lorafleet_services.cli._app import app
from lorafleet_services.cli._help import tidied_command
from lorafleet_services.cli.services import up_agent_config

__all__ = [
    "app",
    "artifacts",
    "auth",
    "catalog",
    "estimate",
    "jobs",
    "main",
    "nats_config",
    "nodes",
    "services",
    "serving",
    "top",
    "up_agent_config",
]


def main() -> None:
    tidied_command(app)()


if __name__ == "__main__":
    main()
