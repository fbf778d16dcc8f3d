"""Hypothesis strategies from the published JSON Schemas (msgspec.json.schema of
the wire Structs, what schemas/json holds): requests valid at their bounds,
and requests wrong in exactly one field, with the path an error must name.

Only what the request schemas use is understood: `$ref`, `anyOf`, `enum`,
objects (properties, required, additionalProperties false), arrays
(items, min/maxItems), strings (pattern, min/maxLength), integers and
numbers (minimum, maximum, exclusive bounds), booleans and null. A schema
with anything else fails loudly (`UnknownSchemaError`) rather than being
fuzzed half-way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
from hypothesis import strategies as st

Schema = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Only:
    """A hint drawn instead of the schema's values, not beside them: for what
    the schema cannot say (msgspec's schema of a datetime is a bare string)."""

    strategy: st.SearchStrategy[Any]


#: Strategies mixed into the schema's for a property of that name (known
#: job ids, the catalog's model): reach past "not found" into the handlers.
#: An `Only` replaces the schema's.
Hints = Mapping[str, "st.SearchStrategy[Any] | Only"]

#: Keys that only describe a schema.
_NOTES = frozenset({"title", "description", "default", "examples"})
#: The bounds of an integer without any: msgspec reads any JSON integer as a
#: Python int, so what a service does with one beyond 64 bits is fuzzed too.
UNBOUNDED_LOW, UNBOUNDED_HIGH = -(2**64), 2**64
#: A key no request Struct has.
UNKNOWN_KEY = "no_such_field"


class UnknownSchemaError(ValueError):
    """A schema keyword these strategies do not understand."""


@dataclass(frozen=True, slots=True)
class Invalid:
    """A request wrong at `field` (a JSON path such as `$.params.rank`)."""

    body: dict[str, Any]
    field: str
    how: str


def request_schema(typ: type) -> tuple[Schema, dict[str, Schema]]:
    """The top-level object schema of `typ` and its `$defs`."""
    doc = msgspec.json.schema(typ)
    defs: dict[str, Schema] = doc.get("$defs", {})
    return resolve(doc, defs), defs


def resolve(schema: Schema, defs: dict[str, Schema]) -> Schema:
    while "$ref" in schema:
        schema = defs[schema["$ref"].rsplit("/", 1)[-1]]
    return schema


def _check_known(schema: Schema, known: set[str]) -> None:
    extra = set(schema) - known - _NOTES
    if extra:
        raise UnknownSchemaError(f"schema keywords {sorted(extra)} in {schema}")


def _integers(schema: Schema) -> st.SearchStrategy[int]:
    _check_known(schema, {"type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})
    low = schema.get("minimum", schema.get("exclusiveMinimum", UNBOUNDED_LOW - 1) + 1)
    high = schema.get("maximum", schema.get("exclusiveMaximum", UNBOUNDED_HIGH + 1) - 1)
    return st.sampled_from([low, high]) | st.integers(low, min(high, low + 10**6))


def _numbers(schema: Schema) -> st.SearchStrategy[float]:
    _check_known(schema, {"type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})
    low = schema.get("minimum", schema.get("exclusiveMinimum"))
    high = schema.get("maximum", schema.get("exclusiveMaximum"))
    inner = st.floats(
        low,
        high,
        exclude_min="exclusiveMinimum" in schema,
        exclude_max="exclusiveMaximum" in schema,
        allow_nan=False,
        allow_infinity=False,
    )
    edges = [b for b in (schema.get("minimum"), schema.get("maximum")) if b is not None]
    return st.sampled_from(edges) | inner if edges else inner


def _strings(schema: Schema) -> st.SearchStrategy[str]:
    _check_known(schema, {"type", "pattern", "minLength", "maxLength"})
    if "pattern" in schema:
        pattern: str = schema["pattern"]  # a str pattern draws str
        return st.from_regex(pattern, fullmatch=True)
    return st.text(min_size=schema.get("minLength", 0), max_size=schema.get("maxLength", 40))


def valid(
    schema: Schema, defs: dict[str, Schema], hints: Hints | None = None
) -> st.SearchStrategy[Any]:
    """Values `schema` accepts, its bounds among them; `hints` replace the
    strategy of properties by name (at any depth)."""
    hints = hints or {}
    schema = resolve(schema, defs)
    if "anyOf" in schema:
        _check_known(schema, {"anyOf"})
        return st.one_of([valid(s, defs, hints) for s in schema["anyOf"]])
    if "enum" in schema:
        _check_known(schema, {"enum"})
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    scalars: dict[str, Callable[[Schema], st.SearchStrategy[Any]]] = {
        "integer": _integers,
        "number": _numbers,
        "string": _strings,
        "boolean": lambda _s: st.booleans(),
        "null": lambda _s: st.none(),
    }
    if kind in scalars:
        return scalars[kind](schema)
    if kind == "array":
        _check_known(schema, {"type", "items", "minItems", "maxItems"})
        return st.lists(
            valid(schema["items"], defs, hints),
            min_size=schema.get("minItems", 0),
            max_size=schema.get("maxItems", 4),
        )
    if kind == "object":
        return _objects(schema, defs, hints)
    raise UnknownSchemaError(f"no strategy for {schema}")


def _objects(schema: Schema, defs: dict[str, Schema], hints: Hints) -> st.SearchStrategy[Any]:
    _check_known(schema, {"type", "properties", "required", "additionalProperties"})
    props: dict[str, Schema] = schema.get("properties", {})
    required = set(schema.get("required", []))

    def prop(name: str) -> st.SearchStrategy[Any]:
        hint = hints.get(name)
        if isinstance(hint, Only):
            return hint.strategy
        own = valid(props[name], defs, hints)
        return hint | own if hint is not None else own

    return st.fixed_dictionaries(
        {n: prop(n) for n in props if n in required},
        optional={n: prop(n) for n in props if n not in required},
    )


def wrong_values(schema: Schema, defs: dict[str, Schema]) -> list[tuple[Any, str]]:
    """Values `schema` refuses, each with what is wrong with it."""
    schema = resolve(schema, defs)
    alternatives = [resolve(s, defs) for s in schema.get("anyOf", [schema])]
    kinds = {a.get("type") for a in alternatives} | {"enum" for a in alternatives if "enum" in a}
    out: list[tuple[Any, str]] = []
    samples = {"string": "x", "integer": 7, "boolean": True, "object": {}, "array": []}
    for kind, value in samples.items():
        accepted = kind in kinds or (kind == "string" and "enum" in kinds)
        accepted = accepted or (kind == "integer" and "number" in kinds)
        if not accepted:
            out.append((value, f"a {kind}"))
    if "null" not in kinds:
        out.append((None, "null"))
    for alt in alternatives:
        if "enum" in alt:
            out.append(("no-such-" + str(alt["enum"][0]), "a value not in its enum"))
        if "minimum" in alt:
            out.append((alt["minimum"] - 1, "below its minimum"))
        if "exclusiveMinimum" in alt:
            out.append((alt["exclusiveMinimum"], "at its exclusive minimum"))
        if "maximum" in alt:
            out.append((alt["maximum"] + 1, "above its maximum"))
        if "pattern" in alt:
            out.append(("has a space.and a dot", "not matching its pattern"))
        if alt.get("type") == "integer" and "number" not in kinds:
            out.append((1.5, "a fraction"))
    return out


def invalid(
    schema: Schema, defs: dict[str, Schema], hints: Hints | None = None
) -> st.SearchStrategy[Invalid]:
    """Requests valid but for one top-level field: a wrong value, a missing
    required field, or a field the Struct does not have."""
    props: dict[str, Schema] = schema.get("properties", {})
    required = sorted(schema.get("required", []))
    mutations: list[tuple[str, Any, str]] = [(UNKNOWN_KEY, 1, "a field it does not have")]
    mutations += [(name, Ellipsis, "missing") for name in required]
    for name, prop_schema in props.items():
        mutations += [(name, value, how) for value, how in wrong_values(prop_schema, defs)]

    @st.composite
    def build(draw: st.DrawFn) -> Invalid:
        body: dict[str, Any] = dict(draw(valid(schema, defs, hints)))
        name, value, how = draw(st.sampled_from(mutations))
        if value is Ellipsis:
            body.pop(name, None)
        else:
            body[name] = value
        return Invalid(body, f"$.{name}", how)

    return build()
