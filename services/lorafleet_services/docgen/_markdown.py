"""Markdown for the generated tables: text from docstrings and help texts,
escaped where Markdown would read it otherwise."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

#: An underscore Markdown may read as emphasis: not between two word characters.
_EDGE_UNDERSCORE = re.compile(r"(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])")


def prose(text: str) -> str:
    """`text` as Markdown: outside `code`, `<`, `*` and a `_` at a word's edge
    are literal (a help text's `<name>` is not an HTML tag, `"_INBOX_"` not
    emphasis; `max_attempts` needs nothing)."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):  # the even parts are outside code spans
        part = parts[i].replace("<", "\\<").replace("*", "\\*")
        parts[i] = _EDGE_UNDERSCORE.sub(r"\\_", part)
    return "`".join(parts)


def code(text: str) -> str:
    """`text` as one code span."""
    return f"`{text}`"


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A Markdown table; a `|` in a cell (in code too, as GitHub reads it) is escaped."""
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)
