"""docs/cli.md's reference: every command of the Typer app, its usage line,
its help and each option's, as `--help` writes them (metavars, defaults,
ranges, required), so that the page cannot say what the app does not."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator

import typer
import typer.main
from typer import _click as click
from typer.core import TyperArgument, TyperGroup

from lorafleet_services.cli import app
from lorafleet_services.cli._help import unwrapped
from lorafleet_services.docgen._markdown import code, prose

#: Click's bracketed extras at the end of an option's help: "[default: 1; required]".
_EXTRAS = re.compile(r"\s*\[([^\[\]]*)\]$")


#: An option (or argument) with the same help in at least this many commands
#: is described once, in the shared list, and named in each command's.
SHARED_FROM = 3

#: The heading the shared options are described under, and a link to it.
SHARED_HEADING = "### Shared options and arguments"
SHARED_LINK = "[shared](#shared-options-and-arguments)"


def commands(root: typer.Typer = app) -> str:
    """The reference: the shared options, then a section per command (a group
    with options of its own too), in --help's order; each option a list item,
    the shared ones named on one line."""
    walked = [
        (path, _options(cmd, ctx), cmd)
        for path, cmd, ctx in _walk(typer.main.get_command(root), ["lorafleet"])
    ]
    counts = Counter(row for _, rows, _ in walked for row in rows)
    shared = [row for row, n in counts.items() if n >= SHARED_FROM]
    sections = [SHARED_HEADING + "\n\n" + _items(shared)]
    for path, rows, cmd in walked:
        own = [row for row in rows if row not in shared]
        common = [name for name, what in rows if (name, what) in shared]
        sections.append(_section(path, cmd, own, common))
    return "\n\n".join(sections)


def _items(rows: list[tuple[str, str]]) -> str:
    """Each option as a list item: "- `--name <type>`: what it does"."""
    return "\n".join(f"- {name}: {what}" for name, what in rows)


def _walk(
    command: click.Command, path: list[str], parent: click.Context | None = None
) -> Iterator[tuple[list[str], click.Command, click.Context]]:
    """Every visible command and group, depth first in --help's order."""
    ctx = click.Context(command, info_name=path[-1], parent=parent)
    if command.hidden:
        return
    if not isinstance(command, TyperGroup) or _options(command, ctx):
        yield path, command, ctx
    if isinstance(command, TyperGroup):
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            if sub is not None:
                yield from _walk(sub, [*path, name], ctx)


def _usage(path: list[str], command: click.Command) -> str:
    """The usage line as `--help` writes it (a required argument as NAME),
    less `[OPTIONS]`: every command has some."""
    pieces = list(path)
    for param in command.params:
        if isinstance(param, TyperArgument):
            name = param.display_name_raw
            pieces.append(name if param.required else f"[{name}]")
    if isinstance(command, TyperGroup):
        pieces += ["[OPTIONS]", "COMMAND [ARGS]..."]  # a group's options come before COMMAND
    return " ".join(pieces)


def _options(command: click.Command, ctx: click.Context) -> list[tuple[str, str]]:
    """(option with its value, help with its extras) of each visible parameter."""
    rows = []
    for param in command.params:
        record = param.get_help_record(ctx)
        if record is None:
            continue
        name, help_text = record
        if isinstance(param, TyperArgument):
            name = param.display_name_raw  # its type is the usage line's business
        extras = _EXTRAS.search(help_text)
        help_md = prose(unwrapped(help_text[: extras.start()] if extras else help_text))
        if extras:
            help_md = f"{help_md} {code('[' + extras.group(1) + ']')}".strip()
        rows.append((code(name), help_md))
    return rows


def _section(
    path: list[str], command: click.Command, rows: list[tuple[str, str]], shared: list[str]
) -> str:
    parts = [f"### {code(_usage(path, command))}"]
    if command.help:
        parts.append(prose(unwrapped(command.help)))
    items = _items(rows)
    if shared:
        items += ("\n" if items else "") + f"- {SHARED_LINK}: " + ", ".join(shared)
    if items:
        parts.append(items)
    return "\n\n".join(parts)
