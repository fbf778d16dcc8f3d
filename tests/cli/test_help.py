"""`--help` as a reader sees it at 80 columns: no type shown for a flag, no
`<list[str]>`, no sentence broken where the docstring's lines end, no
`{JOB}` and no bracket eaten as markup, every option and argument with
its help, every command that shows data with --json — and the Typer
behaviour each workaround in cli/_help.py answers, pinned."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import pytest
import typer
import typer.main
from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption

from lorafleet_services.cli import app
from lorafleet_services.cli._help import tidied_command, unwrapped

COLUMNS = 80
#: A line of a command's entry in a commands panel that another line of the
#: same entry follows is at least this long: rich wrapped it at the width,
#: not at a line break of the docstring (the help column is 62 wide).
MIN_WRAPPED_LINE = 45


def help_of(command: Callable[..., object], *argv: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        command([*argv, "--help"], prog_name="lorafleet")
    assert exited.value.code == 0
    return capsys.readouterr().out


def command_paths(a: typer.Typer, prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    for info in a.registered_commands:
        assert info.name or info.callback is not None
        yield (*prefix, info.name or (info.callback.__name__ if info.callback else ""))
    for group in a.registered_groups:
        assert group.name is not None and group.typer_instance is not None
        yield (*prefix, group.name)
        yield from command_paths(group.typer_instance, (*prefix, group.name))


@pytest.fixture(autouse=True)
def eighty_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", str(COLUMNS))


def test_upstream_typer_shows_a_flag_type_and_keeps_docstring_breaks(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """When this fails, Typer renders help well by itself: drop the
    workaround in cli/_help.py that no longer does anything."""
    plain = typer.Typer()

    @plain.command("one")
    def one(flag: bool = typer.Option(False, "--flag", help="A flag.")) -> None:
        """First line of the doc
        and its second line."""

    @plain.command("two")
    def two(job: str = typer.Argument(..., metavar="JOB")) -> None:
        """Needs lorafleet[train]."""

    listing = help_of(typer.main.get_command(plain), capsys=capsys)
    assert re.search(r"First line of the doc\s*│\n│\s+and its second line", listing), listing
    page = help_of(typer.main.get_command(plain), "one", capsys=capsys)
    assert re.search(r"--flag\s+<bool>", page) and re.search(r"--help\s+<bool>", page), page
    page = help_of(typer.main.get_command(plain), "two", capsys=capsys)
    assert "[OPTIONS] {JOB}" in page and "Needs lorafleet." in page, page


def test_no_help_page_shows_a_flag_type_or_a_python_list(
    capsys: pytest.CaptureFixture[str],
) -> None:
    command = tidied_command(app)
    pages = {path: help_of(command, *path, capsys=capsys) for path in [(), *command_paths(app)]}
    bad = {
        " ".join(path) or "lorafleet": [
            ln for ln in page.splitlines() if "<bool>" in ln or "<list[" in ln
        ]
        for path, page in pages.items()
    }
    assert not {k: v for k, v in bad.items() if v}, bad
    submit = pages[("submit",)]
    assert re.search(r"--param\s+KEY=VALUE", submit) and re.search(r"--watch\s+Follow", submit)


def test_the_command_list_wraps_at_the_width_not_at_docstring_lines(
    capsys: pytest.CaptureFixture[str],
) -> None:
    listing = help_of(tidied_command(app), capsys=capsys)
    entries: list[list[str]] = []
    panel = ""
    for line in listing.splitlines():
        if line.startswith("╭─ "):
            panel = line.strip("╭─╮ ")
        cells = re.fullmatch(r"│ (\S*)\s+(.*?)\s*│", line)
        # The options panel's help column is narrower (the metavars take the rest).
        if cells is None or panel == "Options":
            continue
        name, text = cells.groups()
        if name:
            entries.append([text])
        elif entries:
            entries[-1].append(text)
    assert any(len(e) > 1 for e in entries), listing  # some entry does wrap
    short = [e for e in entries for ln in e[:-1] if len(ln) < MIN_WRAPPED_LINE]
    assert not short, "\n".join(" / ".join(e) for e in short)


def test_unwrapped_joins_lines_and_keeps_paragraphs_and_verbatim_blocks() -> None:
    text = "One line\n    and the next.\n\nA second\nparagraph.\n\n\bkept\n  as is"
    assert unwrapped(text) == "One line and the next.\n\nA second paragraph.\n\n\bkept\n  as is"


def command_tree(
    command: TyperCommand | TyperGroup, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], TyperCommand | TyperGroup]]:
    yield path, command
    if isinstance(command, TyperGroup):
        for name, sub in command.commands.items():
            assert isinstance(sub, TyperCommand | TyperGroup)
            yield from command_tree(sub, (*path, name))


def tidied_tree() -> dict[tuple[str, ...], TyperCommand | TyperGroup]:
    command = tidied_command(app)
    assert isinstance(command, TyperGroup)
    return dict(command_tree(command))


def test_every_option_and_argument_says_what_it_is() -> None:
    tree = tidied_tree()
    assert len(tree) > 25  # the walk reaches every command
    bare = [
        f"lorafleet {' '.join(path)} {param.name}"
        for path, command in tree.items()
        for param in command.params
        if isinstance(param, TyperOption | TyperArgument) and not (param.help or "").strip()
    ]
    assert not bare, bare
    no_doc = [" ".join(path) for path, command in tree.items() if not (command.help or "").strip()]
    assert not no_doc, no_doc


def test_no_help_page_shows_a_placeholder_or_eats_a_bracket(
    capsys: pytest.CaptureFixture[str],
) -> None:
    command = tidied_command(app)
    for path, shown in tidied_tree().items():
        page = help_of(command, *path, capsys=capsys)
        [usage] = [ln for ln in page.splitlines() if "Usage:" in ln]
        assert "{" not in usage and "}" not in usage, usage
        flat = re.sub(r"[\s│]+", " ", page)
        texts = [shown.help or "", *(p.help or "" for p in shown.params if hasattr(p, "help"))]
        written = {m for text in texts for m in re.findall(r"\[[^\]\s]+\]", text)}
        eaten = [m for m in written if m not in flat]
        assert not eaten, (path, eaten, page)


#: Commands that show no data (they run a service, or write files and say
#: where): every other command takes --json.
NO_DATA = {
    ("recorder",), ("scheduler",), ("artifact-store",), ("gateway",), ("agent",), ("up",),
    ("demo",), ("nats-config",), ("auth", "api-key"), ("auth", "api-key", "create"),
    ("models",), ("jobs",), (),
}  # fmt: skip


def test_every_command_that_shows_data_takes_json() -> None:
    without = {
        path
        for path, command in tidied_tree().items()
        if not any(isinstance(p, TyperOption) and "--json" in p.opts for p in command.params)
    }
    assert without == NO_DATA
