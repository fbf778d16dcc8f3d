"""`--help` tidied where Typer's rendering falls short (typer 0.29, rich markup
mode); tests/cli/test_help.py pins each upstream behaviour, so a Typer that
fixes one says so by failing there.

- A flag takes no value, yet Typer shows a type for it (`--watch <bool>`):
  every flag gets an empty metavar.
- Typer keeps a docstring's single line breaks, so the help breaks
  mid-sentence: each paragraph becomes one line, which rich wraps (a
  paragraph starting with \\b stays as written).
- Typer writes a required argument as `{JOB}` in the usage line: it is
  written `JOB`, Click's way (an optional one stays `[JOB]`).
- Typer renders every help text as rich markup, so `lorafleet[train]` shows
  as `lorafleet`: each text is escaped (none of ours uses markup).
- A list option names its values itself (`--param KEY=VALUE`): Typer's
  `<list[str]>` says nothing to a reader.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import typer.main
from rich.markup import escape
from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption

#: What Click treats as a verbatim paragraph (no rewrapping).
VERBATIM_MARK = "\b"


def unwrapped(text: str) -> str:
    """`text` with each paragraph on one line (verbatim ones kept)."""
    paragraphs = text.strip().split("\n\n")
    return "\n\n".join(
        p if p.startswith(VERBATIM_MARK) else " ".join(line.strip() for line in p.splitlines())
        for p in paragraphs
    )


def tidy(command: TyperCommand | TyperGroup) -> None:
    """Tidy the help of `command` and of every command under it, in place."""
    if command.help:
        command.help = escape(unwrapped(command.help))
    if command.short_help:
        command.short_help = escape(command.short_help)
    if command.epilog:
        command.epilog = escape(command.epilog)
    for param in command.params:
        if isinstance(param, TyperOption | TyperArgument) and param.help:
            param.help = escape(param.help)
        if isinstance(param, TyperArgument):
            param.get_usage_pieces = partial(_usage_pieces, param)  # type: ignore[method-assign]
    options = [p for p in command.params if isinstance(p, TyperOption)]
    help_option = command.get_help_option(command.context_class(command))
    if isinstance(help_option, TyperOption):
        options.append(help_option)
    for option in options:
        if option.is_flag and option.metavar is None:
            option.metavar = ""
    if isinstance(command, TyperGroup):
        for sub in command.commands.values():
            if isinstance(sub, TyperCommand | TyperGroup):
                tidy(sub)


def _usage_pieces(argument: TyperArgument, ctx: object) -> list[str]:
    name = argument.display_name_raw
    name = name if argument.required else f"[{name}]"
    return [name + ("..." if argument.nargs != 1 else "")]


def tidied_command(app: typer.Typer) -> Callable[..., object]:
    """The Click command `app` runs as, its help tidied; call it to run
    (with Click's arguments: none reads sys.argv)."""
    command = typer.main.get_command(app)
    if isinstance(command, TyperCommand | TyperGroup):
        tidy(command)
    return command
