"""Write the generated sections of the reference pages from the code.

    python -m lorafleet_services.docgen.generate          # rewrite them
    python -m lorafleet_services.docgen.generate --check  # exit 1 when one is stale

A page keeps its hand-written text; each generated section sits between
`<!-- generated: NAME ... -->` and `<!-- end generated: NAME -->` and is
rewritten whole: docs/cli.md's command reference (the Typer app) and exit
codes (lorafleet.exits), docs/settings.md's variables (the settings
classes), docs/metrics.md's metrics (lorafleet.metrics).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

import lorafleet_services
from lorafleet.exits import markdown_table
from lorafleet_services.docgen import cli_page, metrics_page, settings_page

DOCS = Path(lorafleet_services.__file__).resolve().parents[2] / "docs"
COMMAND = "python -m lorafleet_services.docgen.generate"

#: {page: {section: what renders it}}.
SECTIONS: dict[str, dict[str, Callable[[], str]]] = {
    "cli.md": {"commands": cli_page.commands, "exit-codes": markdown_table},
    "settings.md": {"settings": settings_page.tables},
    "metrics.md": {"metrics": metrics_page.table_of_metrics},
}


class MarkerError(ValueError):
    """A page without the begin and end markers of a section it must hold."""


def begin(name: str) -> str:
    return f"<!-- generated: {name} ({COMMAND}; do not edit) -->"


def end(name: str) -> str:
    return f"<!-- end generated: {name} -->"


def render(text: str, sections: dict[str, Callable[[], str]], page: str = "page") -> str:
    """`text` with each section's content rewritten between its markers."""
    for name, make in sections.items():
        pattern = re.compile(re.escape(begin(name)) + r"\n.*?" + re.escape(end(name)), re.DOTALL)
        found = list(pattern.finditer(text))
        if len(found) != 1:
            raise MarkerError(
                f"{page}: put the lines {begin(name)!r} and {end(name)!r} (once each, in "
                f"that order) where the generated {name} go"
            )
        section = f"{begin(name)}\n\n{make()}\n\n{end(name)}"
        text = text[: found[0].start()] + section + text[found[0].end() :]
    return text


def stale(docs: Path = DOCS) -> list[Path]:
    """The pages whose generated sections differ from the code (or are missing)."""
    out = []
    for page, sections in SECTIONS.items():
        path = docs / page
        text = path.read_text() if path.is_file() else ""
        try:
            fresh = render(text, sections, str(path))
        except MarkerError:
            fresh = None
        if fresh != text:
            out.append(path)
    return out


def main(argv: list[str]) -> int:
    try:
        return _generate(check="--check" in argv)
    except ValueError as e:  # code the pages cannot document (a setting without words, ...)
        print(f"{COMMAND}: {e}", file=sys.stderr)
        return 1


def _generate(check: bool) -> int:
    if check:
        paths = stale()
        for path in paths:
            print(f"{path} is stale: run {COMMAND}", file=sys.stderr)
        return 1 if paths else 0
    for page, sections in SECTIONS.items():
        path = DOCS / page
        path.write_text(render(path.read_text(), sections, str(path)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
