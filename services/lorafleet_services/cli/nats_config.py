"""`lorafleet nats-config`: NATS credentials for a fleet."""

from __future__ import annotations

import sys

import typer

from lorafleet.exits import Exit
from lorafleet.settings import Settings
from lorafleet_services.cli._app import app, fail, print_json


@app.command("nats-config", rich_help_panel="Access")
def nats_config_cmd(
    node: list[str] = typer.Option(
        ..., "--node", metavar="NODE", help="A node's name; repeat for each node."
    ),
    listen: str = typer.Option("0.0.0.0:4222", help="host:port the server listens on."),
    url: str = typer.Option(
        "nats://127.0.0.1:4222",
        help="The URL the processes connect to (nats://host:port; host:port alone will do).",
    ),
    store_dir: str | None = typer.Option(None, help="JetStream's store directory."),
    blocks: bool = typer.Option(False, "--blocks", help="Only the permission blocks, as JSON."),
) -> None:
    """Print a nats-server config: a user for the services and one per node,
    each node allowed only its own subjects (passwords generated), then the
    LORAFLEET_* settings each process runs with, as comments."""
    import secrets

    from lorafleet.access import passwords as perms

    scheme, sep, host_port = url.rpartition("://")
    if sep and scheme != "nats":
        fail(f"--url {url}: give a nats:// URL (for TLS, `lorafleet auth`)", Exit.USAGE)
    names = Settings.from_env().names
    try:
        passwords = {u: secrets.token_urlsafe(18) for u in (perms.SERVICE_USER, *node)}
        users = perms.fleet_users(names, node, passwords)
    except ValueError as e:
        fail(str(e), Exit.REFUSED)
    if blocks:
        print_json({user: block for user, (_pw, block) in users.items()})
        return
    lines = [perms.server_config(users, listen=listen, store_dir=store_dir)]
    lines.append("# Each process's settings (keep this file and these lines secret):")
    for user, (password, _block) in users.items():
        agent = None if user == perms.SERVICE_USER else user
        lines.append(f"#   {user}: {perms.client_env(user, password, host_port, node=agent)}")
    sys.stdout.write("\n".join(lines) + "\n")
