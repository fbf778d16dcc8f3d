"""Each rule stated once: the shapes a rule takes when it is written out again
beside the module that owns it, found in the source and refused.

If changing a rule would mean editing two files, it lives in one; these
checks catch the copies a reader cannot see from the owner's side (a state
set spelled out member by member, a message id built inline).
"""

from __future__ import annotations

import ast

from tests.core.test_code_shape import Module, modules

#: Where the job states are grouped into sets (`FINAL`, `ON_NODE`, ...).
STATES_MODULE = "lorafleet.states"


def _state_members(node: ast.expr) -> int:
    """How many elements of a literal set, tuple or list are `JobState.<X>`
    (0 when it is no such literal or holds anything else)."""
    if not isinstance(node, (ast.Set, ast.Tuple, ast.List)):
        return 0
    members = [
        e
        for e in node.elts
        if isinstance(e, ast.Attribute)
        and isinstance(e.value, ast.Name)
        and e.value.id == "JobState"
    ]
    return len(members) if len(members) == len(node.elts) else 0


def state_sets(mod: Module) -> list[str]:
    """`module:line` of each literal group of two or more job states in `mod`."""
    return [
        f"{mod.name}:{node.lineno}"
        for node in ast.walk(mod.tree)
        if isinstance(node, ast.expr) and _state_members(node) >= 2
    ]


def test_state_sets_are_written_only_in_the_states_module() -> None:
    found = [hit for mod in modules() if mod.name != STATES_MODULE for hit in state_sets(mod)]
    assert found == [], (
        "a set of job states is spelled out beside lorafleet/states.py; name it there "
        f"(or derive it from FINAL, ON_NODE, ACTIVE): {found}"
    )


def test_the_state_set_check_sees_a_copy() -> None:
    copy = ast.parse("if s in (JobState.DONE, JobState.FAILED): pass")
    one = ast.parse("x = ON_NODE - {JobState.STARTING}")
    mapping = ast.parse("d = {JobState.DONE: 0, JobState.FAILED: 1}")
    assert state_sets(Module("m", None, copy)) == ["m:1"]  # type: ignore[arg-type]
    assert state_sets(Module("m", None, one)) == []  # type: ignore[arg-type]
    assert state_sets(Module("m", None, mapping)) == []  # type: ignore[arg-type]


def _number(node: ast.expr) -> float | None:
    """The value of a numeric constant expression (`10.0`, `4 * 1024`), else None."""
    try:
        value = eval(compile(ast.Expression(node), "<constant>", "eval"), {"__builtins__": {}})
    except Exception:  # a name, a call: not a plain number
        return None
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def numeric_constants(mod: Module) -> dict[str, float]:
    """`mod`'s module-level UPPER_CASE names bound to a number."""
    out: dict[str, float] = {}
    for node in mod.tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name) and target.id.lstrip("_").isupper():
            number = _number(value)
            if number is not None:
                out[target.id.lstrip("_")] = number
    return out


def test_a_constant_name_holds_one_value_everywhere() -> None:
    """Two modules' `STOP_GRACE_S` of 2 and 10 bound different things: each
    is named for what it bounds. (The same name with the same value is one
    rule that may be stated twice; two values are two rules under one name.)"""
    seen: dict[str, dict[float, list[str]]] = {}
    for mod in modules():
        for name, value in numeric_constants(mod).items():
            seen.setdefault(name, {}).setdefault(value, []).append(mod.name)
    clashes = {name: values for name, values in seen.items() if len(values) > 1}
    assert clashes == {}, (
        f"one constant name, different values; name each for what it bounds: {clashes}"
    )


def test_the_constant_check_reads_expressions_and_skips_what_is_no_number() -> None:
    tree = ast.parse(
        "A_S = 0.5\nB = 4 * 1024\n_C_S: float = 2\nD = 'x'\nE = f(1)\nF = True\nlow = 1"
    )
    assert numeric_constants(Module("m", None, tree)) == {"A_S": 0.5, "B": 4096, "C_S": 2}  # type: ignore[arg-type]


_RE_CALLS = {"compile", "match", "fullmatch", "search", "findall", "finditer", "sub", "split"}


def regexes(mod: Module) -> set[str]:
    """The regular expressions written out in `mod` (a literal given to `re.*`,
    a `pattern=` keyword, a module-level `*_PATTERN`), anchors left off."""
    found: list[str] = []
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Call):
            f = node.func
            if (
                isinstance(f, ast.Attribute)
                and isinstance(f.value, ast.Name)
                and f.value.id == "re"
                and f.attr in _RE_CALLS
                and node.args
            ):
                found.append(_literal(node.args[0]))
            found += [_literal(k.value) for k in node.keywords if k.arg == "pattern"]
        elif isinstance(node, ast.Assign) and node in mod.tree.body:
            names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            if any(n.endswith("_PATTERN") for n in names):
                found.append(_literal(node.value))
    return {p.removeprefix("^").removesuffix("$") for p in found if p}


def _literal(node: ast.expr) -> str:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else ""


def test_each_regular_expression_is_written_in_one_module() -> None:
    where: dict[str, list[str]] = {}
    for mod in modules():
        for pattern in regexes(mod):
            where.setdefault(pattern, []).append(mod.name)
    twice = {p: mods for p, mods in where.items() if len(mods) > 1}
    assert twice == {}, f"one pattern written in two modules; name it once and import it: {twice}"


def test_the_regex_check_finds_each_way_a_pattern_is_written() -> None:
    tree = ast.parse(
        "import re\nA = re.compile(r'^b(\\d+)$')\nT = Meta(pattern=r'^x$')\n"
        "SHA_PATTERN = r'[0-9a-f]{64}'\ndef f(s): return re.fullmatch(r'y+', s)\n"
        "n = re.compile(NAMED)\n"
    )
    assert regexes(Module("m", None, tree)) == {"b(\\d+)", "x", "[0-9a-f]{64}", "y+"}  # type: ignore[arg-type]


def test_the_trainer_s_file_names_are_spelled_only_in_its_layout() -> None:
    """adapter_config.json and its neighbours: lorafleet_trainer.layout names
    them for the trainer and every reader (the converter, the serving agent)."""
    from lorafleet_trainer import layout

    names = {v for k, v in vars(layout).items() if k.isupper() and isinstance(v, str) and "." in v}
    assert "adapter_config.json" in names
    found = [
        f"{mod.name}:{node.lineno} {node.value}"
        for mod in modules()
        if mod.name != "lorafleet_trainer.layout"
        for node in ast.walk(mod.tree)
        if isinstance(node, ast.Constant) and node.value in names
    ]
    assert found == [], f"spelled out beside lorafleet_trainer/layout.py; import its name: {found}"


def inline_msg_ids(mod: Module) -> list[str]:
    """`module:line` of each `{Header.MSG_ID: <an f-string, a literal or a
    sum>}`: a message id built inline instead of by a lorafleet.names builder."""
    found = []
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if (
                    isinstance(key, ast.Attribute)
                    and key.attr == "MSG_ID"
                    and isinstance(value, (ast.JoinedStr, ast.Constant, ast.BinOp))
                ):
                    found.append(f"{mod.name}:{node.lineno}")
    return found


def test_message_ids_are_built_only_by_the_names_module() -> None:
    found = [hit for mod in modules() for hit in inline_msg_ids(mod)]
    assert found == [], f"a Nats-Msg-Id built inline; use a lorafleet.names *_msg_id: {found}"


def test_the_message_id_check_sees_an_inline_id() -> None:
    inline = ast.parse('h = {Header.MSG_ID: f"{job}.{seq}"}')
    summed = ast.parse('h = {Header.MSG_ID: job + "." + seq}')
    built = ast.parse("h = {Header.MSG_ID: status_msg_id(job, attempt, seq), X: msg.msg_id}")
    assert inline_msg_ids(Module("m", None, inline)) == ["m:1"]  # type: ignore[arg-type]
    assert inline_msg_ids(Module("m", None, summed)) == ["m:1"]  # type: ignore[arg-type]
    assert inline_msg_ids(Module("m", None, built)) == []  # type: ignore[arg-type]
