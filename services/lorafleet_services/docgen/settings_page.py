"""docs/settings.md's tables: every `LORAFLEET_*` variable of the settings
classes (the shared `Settings`, the agent's and the gateway's configs), with
its default and what it does (the page's introduction says how types and
units are written), from each field's `#:` comment or its
entry in the class docstring; and the few variables read outside them."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from collections.abc import Callable
from typing import Any

from lorafleet.settings import Settings
from lorafleet_services.agent.config import AgentConfig
from lorafleet_services.docgen._markdown import code, prose, table
from lorafleet_services.gateway.config import GatewayConfig
from lorafleet_services.local import vllm_cpu

#: (title, class, prefix of its variables), in the page's order.
CLASSES: tuple[tuple[str, type, str], ...] = (
    ("Every process", Settings, "LORAFLEET_"),
    ("The agent (`lorafleet agent`)", AgentConfig, "LORAFLEET_AGENT_"),
    ("The gateway (`lorafleet gateway`)", GatewayConfig, "LORAFLEET_GATEWAY_"),
)

#: Variables read outside the settings classes, each with where it is read:
#: (variable, the code that reads it, default, what).
OTHERS: tuple[tuple[str, Callable[..., Any], str, str], ...] = (
    (
        "LORAFLEET_ENGINES_CACHE",
        vllm_cpu.engines_cache,
        "`~/.cache/lorafleet/engines`",
        "Where the CPU vLLM (`up --serve`, `demo --serve`, the tests) is installed once.",
    ),
)

#: Variables not on the page: the one the agent sets for its trainer
#: (LORAFLEET_JOB_DIR), and the stand-in trainer's knobs, told beside the dry
#: run they serve (docs/deploy.md, "A dry run").
INTERNAL = re.compile(r"^LORAFLEET_(JOB_DIR|STANDIN_\w+)$")

#: A docstring's entry for a field: "name: what it does", continued by indented lines.
_ENTRY = re.compile(r"^(\w+): (.*)$")


class UndocumentedSettingError(ValueError):
    """A settings field with neither a `#:` comment nor a docstring entry."""


def tables() -> str:
    """A table per settings class, then the variables read outside them."""
    parts = []
    for title, cls, prefix in CLASSES:
        rows = [_row(prefix, f, what) for f, what in _described_fields(cls)]
        parts.append(f"### {title}\n\n" + table(("variable", "default", "what"), rows))
    others = [(code(name), default, what) for name, _, default, what in OTHERS]
    parts.append("### Read elsewhere\n\n" + table(("variable", "default", "what"), others))
    return "\n\n".join(parts)


def variables() -> list[str]:
    """Every variable the page documents."""
    names = [
        f"{prefix}{f.name.upper()}" for _, cls, prefix in CLASSES for f in dataclasses.fields(cls)
    ]
    return names + [name for name, *_ in OTHERS]


def _described_fields(cls: type) -> list[tuple[dataclasses.Field[Any], str]]:
    comments = _field_comments(cls)
    entries = _docstring_entries(cls)
    out = []
    for f in dataclasses.fields(cls):
        what = comments.get(f.name) or entries.get(f.name)
        if not what:
            raise UndocumentedSettingError(
                f"{cls.__module__}.{cls.__qualname__}.{f.name} says nowhere what it does: "
                "give it a `#:` comment above it (or an entry in the class docstring)"
            )
        out.append((f, what))
    return out


def _field_comments(cls: type) -> dict[str, str]:
    """Each field's `#:` comment lines right above it, joined."""
    source = inspect.cleandoc(inspect.getsource(cls))
    lines = source.splitlines()
    out = {}
    (cls_node,) = ast.parse(source).body
    for node in cls_node.body if isinstance(cls_node, ast.ClassDef) else ():  # fields only
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            comment: list[str] = []
            i = node.lineno - 2
            while i >= 0 and lines[i].strip().startswith("#:"):
                comment.insert(0, lines[i].strip().removeprefix("#:").strip())
                i -= 1
            if comment:
                out[node.target.id] = " ".join(comment)
    return out


def _docstring_entries(cls: type) -> dict[str, str]:
    """The class docstring's "name: ..." entries, each joined into one line."""
    out: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in inspect.cleandoc(cls.__doc__ or "").splitlines():
        entry = _ENTRY.match(line)
        if entry:
            current = out.setdefault(entry.group(1), [entry.group(2)])
        elif current is not None and line.startswith(" "):
            current.append(line.strip())
        else:
            current = None
    return {name: " ".join(words) for name, words in out.items()}


#: A closing "; default 5." that only repeats the default column.
_SAYS_DEFAULT = re.compile(r'(?:;|\.)\s*[Dd]efault:?\s+"?([^\s";,()]+?)"?\s*\.$')


def _row(prefix: str, f: dataclasses.Field[Any], what: str) -> tuple[str, ...]:
    default = _default(f)
    said = _SAYS_DEFAULT.search(what)
    if said and _as_cell(said.group(1)) == default:
        what = what[: said.start()] + "."
    what = what[:1].upper() + what[1:]
    return (code(f"{prefix}{f.name.upper()}"), default, prose(what))


def _as_cell(said: str) -> str:
    """A default as a comment says it ("none", "False", "5") as the default column has it."""
    if said in ("none", "None"):
        return "none"
    return code(said.lower() if said in ("True", "False") else said)


def _default(f: dataclasses.Field[Any]) -> str:
    if f.default_factory is not dataclasses.MISSING:
        # Computed where it runs (a home directory): what the factory says it is.
        return prose(" ".join((f.default_factory.__doc__ or "computed").split()))
    value = f.default
    if value is dataclasses.MISSING:
        return "required"
    if value is None or value == ():
        return "none"
    if isinstance(value, tuple):
        return code(",".join(map(str, value)))
    if isinstance(value, bool):
        return code(str(value).lower())
    if isinstance(value, float):
        number = code(str(int(value)) if value.is_integer() else str(value))
        return number + _seconds_in_words(value) if f.name.endswith("_s") else number
    if isinstance(value, int) and f.name.endswith("_bytes") and value % 1024 == 0:
        return f"{code(str(value))} ({value // 1024} KiB)"
    return code(str(value)) if value != "" else '`""`'


def _seconds_in_words(seconds: float) -> str:
    """ " (14 days)" or " (2 h)" for a whole number of days or hours, else ""."""
    for unit, size in (("days", 86400), ("h", 3600)):
        if seconds >= size and seconds % size == 0:
            n = int(seconds // size)
            return f" ({n} {unit if unit != 'days' or n > 1 else 'day'})"
    return ""
