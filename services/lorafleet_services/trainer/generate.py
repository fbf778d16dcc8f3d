"""Write the trainer script's parameter table from `TrainerParams`.

    python -m lorafleet_services.trainer.generate          # rewrite the block
    python -m lorafleet_services.trainer.generate --check  # exit 1 when it is stale

The bounds of every trainer parameter are declared once, as msgspec `Meta`
on `TrainerParams` (lorafleet_schemas.messages). The script cannot import
msgspec or lorafleet (it runs in the engine's Python), so this writes what
it needs, the `Params` dataclass and `PARAM_RULES`, between two marker lines
inside script.py. A block inside the script, not a module beside it: the
agent copies one file into the job directory and the tests load that one
file by path, so nothing else has to travel with it.
"""

from __future__ import annotations

import json
import sys
import typing
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect as mi

from lorafleet_schemas.messages import TrainerParams

SCRIPT = Path(__file__).with_name("script.py")
BEGIN = "# BEGIN GENERATED PARAMS: python -m lorafleet_services.trainer.generate; do not edit"
END = "# END GENERATED PARAMS"


class UnsupportedParamError(TypeError):
    """A TrainerParams field of a shape the script's checker does not know."""


def _bounds(info: mi.IntType | mi.FloatType) -> dict[str, float | int]:
    return {k: v for k in ("gt", "ge", "lt", "le") if (v := getattr(info, k)) is not None}


def _rule(name: str, info: Any) -> tuple[str, str, dict[str, Any]]:
    """(annotation in the script, kind, bounds) of one field."""
    if isinstance(info, mi.BoolType):
        return "bool", "bool", {}
    if isinstance(info, mi.IntType):
        bounds = _bounds(info)
        # The script's integer check speaks of ranges ("between 1 and 1024").
        if "gt" in bounds:
            bounds["ge"] = bounds.pop("gt") + 1
        if "lt" in bounds:
            bounds["le"] = bounds.pop("lt") - 1
        return "int", "int", dict(sorted(bounds.items()))
    if isinstance(info, mi.FloatType):
        return "float", "float", _bounds(info)
    if isinstance(info, mi.LiteralType) and all(isinstance(v, str) for v in info.values):
        # In the order written (msgspec's type info sorts them).
        declared = typing.get_args(typing.get_type_hints(TrainerParams)[name])
        return "str", "choice", {"values": tuple(declared)}
    if isinstance(info, mi.UnionType):
        lists = [t for t in info.types if isinstance(t, mi.ListType)]
        words = [t for t in info.types if isinstance(t, mi.LiteralType)]
        if len(lists) == 1 and len(words) == 1 and isinstance(lists[0].item_type, mi.StrType):
            return "list[str] | str", "modules", {"word": words[0].values[0]}
    raise UnsupportedParamError(f"TrainerParams.{name}: the script cannot check {info!r}")


def _literal(v: Any) -> str:
    """`v` as Python source the way ruff formats it (double quotes)."""
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, tuple):
        items = [_literal(x) for x in v]
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    if isinstance(v, list):
        return "[" + ", ".join(_literal(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_literal(k)}: {_literal(x)}" for k, x in v.items()) + "}"
    return repr(v)


def render() -> str:
    """The block, markers included, as it must stand in script.py."""
    info = mi.type_info(TrainerParams)
    if not isinstance(info, mi.StructType):
        raise TypeError(f"TrainerParams is not a Struct: {info!r}")
    fields: list[str] = []
    rules: list[str] = []
    for f in info.fields:
        annotation, kind, bounds = _rule(f.name, f.type)
        default = f.default if f.default is not msgspec.NODEFAULT else f.default_factory()
        if annotation == "float":
            default = float(default)
        fields.append(f"    {f.name}: {annotation} = {_literal(default)}")
        rules.append(f"    {_literal(f.name)}: ({_literal(kind)}, {_literal(bounds)}),")
    lines = [
        BEGIN,
        "@dataclasses.dataclass(frozen=True)",
        "class Params:",
        '    """TrainerParams (lorafleet_schemas.messages), re-validated here: the script',
        '    cannot trust its caller."""',
        "",
        *fields,
        "",
        "",
        "#: Each parameter's check: (kind, bounds). kind: int and float (bounds gt, ge,",
        "#: lt, le), bool, choice (bounds: the values) or modules (a non-empty list of",
        "#: module names, or the one word).",
        "PARAM_RULES: dict[str, tuple[str, dict[str, Any]]] = {",
        *rules,
        "}",
        END,
    ]
    return "\n".join(lines) + "\n"


def rewrite(text: str) -> str:
    """`text` (script.py) with its generated block replaced by `render()`."""
    try:
        head, rest = text.split(BEGIN + "\n", 1)
        _, tail = rest.split(END + "\n", 1)
    except ValueError:
        raise SystemExit(f"{SCRIPT} has no {BEGIN!r} ... {END!r} block") from None
    return head + render() + tail


def is_stale(path: Path = SCRIPT) -> bool:
    text = path.read_text(encoding="utf-8")
    return rewrite(text) != text


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--check" in argv:
        if is_stale():
            print(
                f"{SCRIPT} has a stale parameter table: run "
                "python -m lorafleet_services.trainer.generate",
                file=sys.stderr,
            )
            return 1
        return 0
    text = SCRIPT.read_text(encoding="utf-8")
    SCRIPT.write_text(rewrite(text), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
