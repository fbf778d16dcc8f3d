"""The one table of exit codes (lorafleet/exits.py): each code one meaning, the
same table in docs/cli.md and at the end of `lorafleet --help`. That each
code comes from the real command: test_commands.py's
test_each_exit_code_comes_from_the_real_command."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer._click.exceptions import UsageError

from lorafleet import _runtime as runtime
from lorafleet.exits import MEANINGS, Exit, markdown_table
from lorafleet_services.cli import app
from lorafleet_services.cli._help import tidied_command
from tests.cli.test_help import help_of

DOCS = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def test_each_code_has_one_meaning_and_usage_is_clicks() -> None:
    assert list(MEANINGS) == list(Exit)
    assert len({int(code) for code in Exit}) == len(Exit)
    assert len(set(MEANINGS.values())) == len(MEANINGS)
    # Click exits with its own code on a malformed command line, before any of ours runs.
    assert UsageError.exit_code == Exit.USAGE
    # A service run as a command (`lorafleet recorder`) exits 2 on a bad setting
    # as the runtime does; its 1 for no NATS server becomes Exit.UNREACHABLE.
    assert runtime.EXIT_SETTINGS == Exit.USAGE
    assert runtime.EXIT_CONNECT == Exit.UNREACHABLE


def test_the_docs_print_the_table() -> None:
    assert markdown_table() in DOCS.read_text()


def test_lorafleet_help_ends_with_the_table(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    page = help_of(tidied_command(app), capsys=capsys)
    flat = re.sub(r"\s+", " ", page)
    for code, meaning in MEANINGS.items():
        assert f"{code.value} {meaning.replace('`', '')}" in flat, (code, page)
