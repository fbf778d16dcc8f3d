"""The image's wheel, built from exactly what compose/Dockerfile copies.

Docker is not needed (nor here): the Dockerfile's COPY lines are read, those
paths alone are copied into an empty directory, and the wheel is built from
it as the image's `pip install .` builds it (hatchling, no dependencies).
It must hold every import root pyproject.toml names and the JSON Schemas;
installed alone into a fresh venv (the test venv's packages reached through a
.pth line, so nothing is downloaded and the repository's sources are not on
the path), every service module imports and every service's `lorafleet
<service> --help` answers. One wheel for every check: a build costs about a
second, a venv with the wheel a few.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "compose" / "Dockerfile"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
#: Each import root's folder in the repository (trainer/lorafleet_trainer, ...).
IMPORT_ROOTS = PYPROJECT["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]
#: The services the image runs: every `<package>/service.py` (its runtime.Program).
SERVICE_MODULES = sorted(
    f"lorafleet_services.{p.parent.name}.service"
    for p in (ROOT / "services" / "lorafleet_services").glob("*/service.py")
)
#: Seconds a build, an install or one entrypoint may take.
STEP_TIMEOUT_S = 120


def copy_lines(dockerfile: str) -> list[tuple[list[str], str]]:
    """Each COPY's sources and destination (relative to WORKDIR)."""
    copies = []
    for line in dockerfile.splitlines():
        words = shlex.split(line, comments=True)
        if words and words[0].upper() == "COPY":
            args = [w for w in words[1:] if not w.startswith("--")]
            copies.append((args[:-1], args[-1]))
    return copies


def copy_as_docker_does(dockerfile: str, into: Path) -> None:
    """What the image's COPY lines put into its WORKDIR, from the repository."""
    for sources, dest in copy_lines(dockerfile):
        for source in sources:
            is_dir = dest.endswith("/") or dest == "." or len(sources) > 1
            target = into / dest / Path(source).name if is_dir else into / dest
            target.parent.mkdir(parents=True, exist_ok=True)
            if (ROOT / source).is_dir():
                shutil.copytree(ROOT / source, target, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(ROOT / source, target)


def run(*argv: str | Path, cwd: Path) -> str:
    done = subprocess.run(
        [str(a) for a in argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=STEP_TIMEOUT_S,
        env={"PATH": "/usr/bin:/bin", "HOME": str(cwd)},
    )
    assert done.returncode == 0, f"{argv} exited {done.returncode}:\n{done.stdout}{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    context = tmp_path_factory.mktemp("image")
    copy_as_docker_does(DOCKERFILE.read_text(), context / "app")
    out = context / "dist"
    run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "--disable-pip-version-check",
        "-w",
        out,
        context / "app",
        cwd=context,
    )
    (built,) = out.glob("lorafleet-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel: Path) -> Path:
    """A fresh venv holding the wheel alone, its dependencies the test venv's."""
    root = wheel.parent.parent / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", root, cwd=wheel.parent)
    python = root / "bin" / "python"
    site = run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))", cwd=root)
    # A plain path line: the test venv's own .pth files (its editable install
    # of the repository) are not read from a directory added this way.
    (Path(site.strip()) / "test_venv.pth").write_text(sysconfig.get_path("purelib") + "\n")
    run(
        sys.executable,
        "-m",
        "pip",
        "--python",
        python,
        "install",
        "-q",
        "--no-deps",
        "--disable-pip-version-check",
        wheel,
        cwd=root,
    )
    return root


def test_the_dockerfile_copies_what_the_wheel_is_built_from() -> None:
    copied = {s for sources, _ in copy_lines(DOCKERFILE.read_text()) for s in sources}
    needed = {"pyproject.toml", "README.md"} | {p.split("/")[0] for p in IMPORT_ROOTS}
    assert needed <= copied, f"compose/Dockerfile does not COPY {sorted(needed - copied)}"


def test_the_wheel_holds_every_import_root_and_the_schemas(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    for root in IMPORT_ROOTS:
        package = root.split("/")[-1]
        assert f"{package}/__init__.py" in names, f"the image's wheel lacks {package}"
    assert any(n.startswith("lorafleet_schemas/json/") and n.endswith(".json") for n in names)


def test_every_service_imports_and_answers_help_from_the_wheel(venv: Path) -> None:
    assert SERVICE_MODULES, "no service modules found"
    code = (
        "import importlib, sys\n"
        f"for name in {SERVICE_MODULES!r}:\n"
        "    module = importlib.import_module(name)\n"
        f"    assert module.__file__.startswith({str(venv)!r}), module.__file__\n"
        "    print(name.split('.')[1].replace('_', '-'))\n"
    )
    commands = run(venv / "bin" / "python", "-c", code, cwd=venv).split()
    for command in commands:
        shown = run(venv / "bin" / "lorafleet", command, "--help", cwd=venv)
        assert f"lorafleet {command}" in shown, shown
