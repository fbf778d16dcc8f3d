"""The code's shape, checked: imports point downward with no cycles, and no
module, class or function grows past what one reader can hold.

trainer (lorafleet_trainer) -> schemas (lorafleet_schemas) -> libs
(lorafleet) -> services (lorafleet_services): a lower root never imports a
higher one, and no two modules import each other, even through others or
inside a function. The trainer, at the bottom, imports nothing of the
others: it runs in the node's vLLM Python.

Why not import-linter: its layers contract would say the roots' order
(MAY_IMPORT, a dict here), but not "no cycle between any two modules";
its acyclic-siblings contract checks siblings of one package, not the
whole graph. The search below is Tarjan's, 40 lines, tested with a cycle
of its own, and reads function-level imports as import-linter does.

Package folders are kept small (at most MAX_FOLDER_MODULES modules each),
and docs/architecture.md's module map lists every folder and module: a
module missing from it, or listed there but gone, fails here.
"""

from __future__ import annotations

import ast
import functools
import multiprocessing
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "lorafleet_trainer": ROOT / "trainer" / "lorafleet_trainer",
    "lorafleet_schemas": ROOT / "schemas" / "lorafleet_schemas",
    "lorafleet": ROOT / "libs" / "lorafleet",
    "lorafleet_services": ROOT / "services" / "lorafleet_services",
}
#: Each root may import the roots listed for it, and itself.
_TRAINER = {"lorafleet_trainer"}
MAY_IMPORT = {
    "lorafleet_trainer": _TRAINER,
    "lorafleet_schemas": _TRAINER | {"lorafleet_schemas"},
    "lorafleet": _TRAINER | {"lorafleet_schemas", "lorafleet"},
    "lorafleet_services": _TRAINER | {"lorafleet_schemas", "lorafleet", "lorafleet_services"},
}
#: Programs that run outside lorafleet's environment (the node's vLLM
#: Python) and import none of it.
SELF_CONTAINED = ("lorafleet_trainer",)
MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 350
MAX_FUNCTION_LINES = 60
#: Modules one package folder may hold: the `*.py` directly in it, its
#: `__init__.py` and `__main__.py` not counted (as shape.py counts them).
MAX_FOLDER_MODULES = 20
#: Not counted in a folder, nor listed in the module map: the folder stands for them.
PACKAGE_FILES = ("__init__.py", "__main__.py")
#: The one module map: a section of docs/architecture.md.
ARCHITECTURE = ROOT / "docs" / "architecture.md"
MAP_HEADING = "## Module map"
#: Written by a generator (and checked fresh by `./dev check`), not by hand.
GENERATED_MARK = "do not edit."


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    tree: ast.Module


def modules() -> Iterator[Module]:
    yield from _parsed()


@functools.cache
def _parsed() -> tuple[Module, ...]:
    """Every module, parsed once, in a fresh interpreter: CPython 3.11.7's AST
    conversion keeps a recursion count per process that a failed conversion
    leaves off, and every later ast.parse in that process then raises
    "SystemError: AST constructor recursion depth mismatch". Under xdist a
    worker runs this after tests of every kind, and one had left it so."""
    named = []
    for top, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            parts = [top, *rel.parts]
            if parts[-1] == "__init__":
                parts.pop()
            named.append((".".join(parts), path))
    sources = [path.read_text() for _, path in named]
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as fresh:
        trees = fresh.map(ast.parse, sources, [str(path) for _, path in named], chunksize=64)
        return tuple(
            Module(name, path, tree) for (name, path), tree in zip(named, trees, strict=True)
        )


def imported(mod: Module, known: set[str]) -> set[str]:
    """The project modules `mod` imports, anywhere in it (a function-level
    import is an import too)."""
    out: set[str] = set()
    package = mod.name if mod.path.name == "__init__.py" else mod.name.rpartition(".")[0]
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import mod` imports pkg.mod (and runs pkg/__init__,
            # which imports what it imports itself: not an edge of this module).
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in known else base)
    return {name for name in out if name in known}


def graph() -> dict[str, set[str]]:
    mods = list(modules())
    known = {m.name for m in mods}
    return {m.name: imported(m, known) - {m.name} for m in mods}


def test_imports_point_downward() -> None:
    wrong = [
        f"{src} imports {dst}"
        for src, dsts in graph().items()
        for dst in dsts
        if dst.split(".")[0] not in MAY_IMPORT[src.split(".")[0]]
    ]
    assert not wrong, (
        "imports must point downward (trainer -> schemas -> libs -> services):\n" + "\n".join(wrong)
    )


#: The services that run on their own: each imports no other (what two need is
#: libs'); the CLI, which starts them all, and `local`, stack, demo may.
SERVICES = ("recorder", "scheduler", "artifact_store", "agent", "gateway", "paramgen")


def sideways(g: dict[str, set[str]]) -> list[str]:
    """Imports from one service's package into another's."""

    def service(name: str) -> str | None:
        parts = name.split(".")
        if parts[0] == "lorafleet_services" and len(parts) > 1 and parts[1] in SERVICES:
            return parts[1]
        return None

    return sorted(
        f"{src} imports {dst}"
        for src, dsts in g.items()
        for dst in dsts
        if service(src) and service(dst) and service(src) != service(dst)
    )


def test_no_service_imports_another() -> None:
    wrong = sideways(graph())
    assert not wrong, "move what two services share into libs:\n" + "\n".join(wrong)


def test_a_sideways_import_is_found() -> None:
    g = {"lorafleet_services.gateway.service": {"lorafleet_services.scheduler.kv_watch"},
         "lorafleet_services.cli.up": {"lorafleet_services.scheduler.service"}}  # fmt: skip
    assert sideways(g) == [
        "lorafleet_services.gateway.service imports lorafleet_services.scheduler.kv_watch"
    ]


def test_the_trainer_imports_nothing_of_lorafleet() -> None:
    wrong = [
        f"{src} imports {dst}"
        for src, dsts in graph().items()
        if src.startswith(SELF_CONTAINED)
        for dst in dsts
        if not dst.startswith(SELF_CONTAINED)
    ]
    assert not wrong, "\n".join(wrong)


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles() -> None:
    assert cycles(graph()) == []


def test_a_cycle_is_found() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def sizes() -> Iterator[tuple[str, str, str, int]]:
    for mod in modules():
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                yield kind, mod.name, node.name, lines


@pytest.mark.parametrize(
    ("kind", "limit"), [("class", MAX_CLASS_LINES), ("function", MAX_FUNCTION_LINES)]
)
def test_nothing_grows_past_one_readers_hold(kind: str, limit: int) -> None:
    over = sorted(
        f"{mod}.{name}: {lines} lines"
        for k, mod, name, lines in sizes()
        if k == kind and lines > limit
    )
    assert not over, f"over {limit} lines ({kind}); split them at their seams:\n" + "\n".join(over)


def test_no_module_grows_past_one_readers_hold() -> None:
    over = sorted(
        f"{mod.name}: {lines} lines"
        for mod in modules()
        if (lines := len(mod.path.read_text().splitlines())) > MAX_MODULE_LINES
        and GENERATED_MARK not in (ast.get_docstring(mod.tree) or "")
    )
    assert not over, f"modules over {MAX_MODULE_LINES} lines; split them at their seams:\n" + (
        "\n".join(over)
    )


def test_package_code_never_asserts() -> None:
    """`assert` vanishes under `python -O` and an AssertionError reads as a
    test failure: package code raises an error that says what happened."""
    found = [
        f"{mod.name}:{node.lineno}"
        for mod in modules()
        for node in ast.walk(mod.tree)
        if isinstance(node, ast.Assert)
        or (
            isinstance(node, ast.Raise)
            and isinstance(node.exc, ast.Call | ast.Name)
            and "AssertionError" in ast.unparse(node.exc)
        )
    ]
    assert not found, "asserts in package code:\n" + "\n".join(found)


def folder_modules() -> dict[str, set[str]]:
    """Each package folder (its path from the repository root) and the
    modules directly in it, PACKAGE_FILES left out."""
    out: dict[str, set[str]] = {}
    for folder in PACKAGES.values():
        for path in folder.rglob("*.py"):
            names = out.setdefault(path.parent.relative_to(ROOT).as_posix(), set())
            if path.name not in PACKAGE_FILES:
                names.add(path.name)
    return out


def overfull(folders: dict[str, set[str]], limit: int) -> list[str]:
    return sorted(f"{f} holds {len(m)} modules" for f, m in folders.items() if len(m) > limit)


def test_no_package_folder_grows_past_one_readers_hold() -> None:
    over = overfull(folder_modules(), MAX_FOLDER_MODULES)
    assert not over, (
        f"package folders over {MAX_FOLDER_MODULES} modules; group them into subpackages named "
        "for what each holds:\n" + "\n".join(over)
    )


def test_an_overfull_folder_is_found() -> None:
    folders = {"agent": {f"m{i}.py" for i in range(21)}, "small": {"a.py"}}
    assert overfull(folders, 20) == ["agent holds 21 modules"]


def mapped_modules(text: str) -> dict[str, set[str]]:
    """The module map's folders (`### <folder>/` headings) and the modules
    listed under each (lines starting with `` - `name.py` ``)."""
    if MAP_HEADING not in text:
        return {}
    section = text.split(MAP_HEADING, 1)[1].split("\n## ", 1)[0]
    out: dict[str, set[str]] = {}
    folder: str | None = None
    for line in section.splitlines():
        if line.startswith("### "):
            folder = line[4:].strip().rstrip("/")
            out[folder] = set()
        elif line.startswith("- `") and folder is not None:
            out[folder].add(line[3:].split("`", 1)[0])
    return out


def map_differences(actual: dict[str, set[str]], mapped: dict[str, set[str]]) -> list[str]:
    missing = [
        f"missing from the map: {folder}/{name}"
        if folder in mapped
        else f"missing from the map: the folder {folder}/"
        for folder, names in actual.items()
        for name in sorted(names - mapped.get(folder, set())) or ([] if folder in mapped else [""])
    ]
    gone = [
        f"listed in the map but gone: {folder}/{name}"
        for folder, names in mapped.items()
        for name in sorted(names - actual.get(folder, set())) or ([] if folder in actual else [""])
    ]
    return sorted(set(missing)) + sorted(set(gone))


def test_the_module_map_lists_every_module() -> None:
    wrong = map_differences(folder_modules(), mapped_modules(ARCHITECTURE.read_text()))
    assert not wrong, (
        f"docs/architecture.md's {MAP_HEADING!r} disagrees with the tree; list each module "
        "with a few words, under its folder:\n" + "\n".join(wrong)
    )


def test_a_map_difference_is_found() -> None:
    text = "## Module map\n\n### pkg/\n\n- `kept.py`: here\n- `gone.py`: was here\n\n## Next\n"
    actual = {"pkg": {"kept.py", "new.py"}, "pkg/sub": {"x.py"}}
    assert map_differences(actual, mapped_modules(text)) == [
        "missing from the map: pkg/new.py",
        "missing from the map: the folder pkg/sub/",
        "listed in the map but gone: pkg/gone.py",
    ]
