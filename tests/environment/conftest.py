"""Fixtures for the trainer's environment: the pinned wheels and uv (from
PyPI, cached across runs), a stand-in "vLLM" interpreter, and the engines'
test user.

- The wheel cache is ~/.cache/lorafleet-test-wheels (LORAFLEET_TEST_WHEEL_CACHE
  overrides it); the first run downloads about 19 MB, later runs nothing.
- The stand-in vLLM Python is a real venv made from a base interpreter the
  test user can run (the project's own lives under /root, 0700), whose
  site-packages are the project's own minus peft and accelerate (hard links
  where they share a filesystem, so a checkout under a 0700 directory works):
  it has torch and transformers like a vLLM install, and needs the overlay
  for the rest.
  `<engines_dir>/vllm/<version>/bin/python3` is a shell script that logs its
  arguments and execs it, so a test can count installs.
"""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from lorafleet_services.agent.config import OVERLAY_PACKAGES

TEST_USER = "lorafleet-test-engine"
UV_PIN = "uv==0.13.9"


@dataclass(frozen=True)
class Engines:
    """A node's engines directory with a stand-in vLLM (and maybe uv)."""

    root: Path
    python: Path  # the newest vLLM's bin/python3 (the logging wrapper)
    log: Path  # one line per invocation of a wrapper

    def calls(self, needle: str) -> int:
        if not self.log.exists():
            return 0
        return sum(needle in line for line in self.log.read_text().splitlines())


def _cache_dir() -> Path:
    d = Path(
        os.environ.get("LORAFLEET_TEST_WHEEL_CACHE")
        or Path.home() / ".cache" / "lorafleet-test-wheels"
    )
    d.mkdir(parents=True, exist_ok=True)
    return d


def _download(reqs: list[str], into: Path) -> None:
    into.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(into), *reqs],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if r.returncode != 0:
        pytest.fail(f"downloading {reqs} from PyPI failed: {r.stderr[-2000:]}")


@pytest.fixture(scope="session")
def wheel_dir() -> Path:
    """A local directory holding exactly the pinned overlay wheels."""
    d = _cache_dir() / "pins"
    names = [p.split("==")[0] for p in OVERLAY_PACKAGES]
    if not all(
        any(d.glob(f"{n}-{p.split('==')[1]}-*.whl"))
        for n, p in zip(names, OVERLAY_PACKAGES, strict=True)
    ):
        _download(list(OVERLAY_PACKAGES), d)
    return d


@pytest.fixture(scope="session")
def uv_binary() -> Path:
    """The uv binary out of its PyPI wheel, cached."""
    d = _cache_dir() / UV_PIN.replace("==", "-")
    exe = d / "uv"
    if not exe.exists():
        _download([UV_PIN], d)
        whl = next(d.glob("uv-*.whl"))
        with zipfile.ZipFile(whl) as z:
            member = next(n for n in z.namelist() if n.endswith(".data/scripts/uv"))
            tmp = d / "uv.part"
            tmp.write_bytes(z.read(member))
        tmp.chmod(0o755)
        tmp.rename(exe)
    return exe


@pytest.fixture(scope="session")
def open_dir() -> Iterator[Path]:
    """A directory every user can pass through (tmp_path is under a 0700 root dir)."""
    d = Path(tempfile.mkdtemp(prefix="lorafleet-env-", dir="/tmp"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _base_python() -> str:
    """A base interpreter of this Python's minor version that other users can run."""
    v = f"{sys.version_info.major}.{sys.version_info.minor}"
    for cand in (f"/usr/bin/python{v}", f"/usr/local/bin/python{v}"):
        if os.access(cand, os.X_OK):
            return cand
    return os.path.realpath(str(getattr(sys, "_base_executable", sys.executable)))


def _link_tree(src: Path, dst: Path) -> None:
    """`dst` as `src`'s files hard-linked (no bytes copied). A symlink would
    do, but its target must be reachable by the engines' user, and a checkout
    under a 0700 directory (mktemp -d) is not; a hard link lives where it is made."""
    if src.is_dir() and not src.is_symlink():
        shutil.copytree(src, dst, symlinks=True, copy_function=os.link, dirs_exist_ok=True)
    else:
        os.link(src, dst, follow_symlinks=False)


@pytest.fixture(scope="session")
def engine_venv(open_dir: Path) -> Path:
    """A venv with the project's packages but not peft or accelerate; its python."""
    venv = open_dir / "engine-venv"
    subprocess.run([_base_python(), "-m", "venv", "--without-pip", str(venv)], check=True)
    ours = Path(sysconfig.get_paths()["purelib"])
    (site,) = venv.glob("lib/python*/site-packages")
    same_device = ours.stat().st_dev == site.stat().st_dev
    for entry in _site_entries(ours) if same_device else ours.iterdir():
        if entry.name.lower().startswith(("peft", "accelerate")):
            continue
        if same_device:
            _link_tree(entry, site / entry.name)
        else:  # the engines' user must be able to reach `ours` then
            (site / entry.name).symlink_to(entry)
    return venv / "bin" / "python"


def _site_entries(site: Path) -> list[Path]:
    """What `site` holds, an editable install's .pth (lines naming the
    checkout's source folders) replaced by the packages those folders hold."""
    entries: list[Path] = []
    for entry in site.iterdir():
        lines = entry.read_text().split() if entry.suffix == ".pth" else []
        if lines and all(Path(line).is_absolute() and Path(line).is_dir() for line in lines):
            folders = [Path(line) for line in lines]
            entries += [p.parent for f in folders for p in f.glob("*/__init__.py")]
        else:
            entries.append(entry)
    return entries


def _wrapper(path: Path, target: str, log: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tag = path.parent.parent.name  # the version directory: which wrapper ran
    path.write_text(f'#!/bin/sh\n{{ echo "{tag} $*" >> {log}; }} 2>/dev/null\nexec {target} "$@"\n')
    path.chmod(0o755)


def make_engines(root: Path, engine_python: Path, uv: Path | None = None) -> Engines:
    """engines_dir with vLLM 0.11.0 (the stand-in), 0.9.2 (broken: must lose,
    though it sorts last as a string) and 0.12.0 (no interpreter: ignored)."""
    log = root / "calls.log"
    root.mkdir(parents=True, exist_ok=True)
    newest = root / "vllm" / "0.11.0" / "bin" / "python3"
    _wrapper(newest, str(engine_python), log)
    _wrapper(root / "vllm" / "0.9.2" / "bin" / "python3", "/bin/false", log)
    (root / "vllm" / "0.12.0").mkdir(parents=True)
    if uv is not None:
        _wrapper(root / "uv" / "0.13.9" / "uv", str(uv), log)
    return Engines(root=root, python=newest, log=log)


@pytest.fixture(scope="session")
def engine_user() -> str:
    """The engines' test user, in the video group where there is one."""
    if os.geteuid() != 0:
        pytest.skip("running the trainer as another user needs root; these tests run as a user")
    try:
        pwd.getpwnam(TEST_USER)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", TEST_USER],
            check=True,
        )
    for g in ("video", "render"):
        try:
            grp.getgrnam(g)
        except KeyError:
            continue
        subprocess.run(["usermod", "-aG", g, TEST_USER], check=True)
    return TEST_USER


@pytest.fixture(scope="session")
def bare_python(open_dir: Path) -> Path:
    """A venv with nothing: no torch, no pip."""
    venv = open_dir / "bare-venv"
    subprocess.run([_base_python(), "-m", "venv", "--without-pip", str(venv)], check=True)
    return venv / "bin" / "python"


@pytest.fixture(scope="session")
def user_engine_venv(engine_venv: Path, engine_user: str) -> Path:
    """engine_venv, when the engines' test user can start it."""
    r = subprocess.run(
        [str(engine_venv), "-c", "import torch"],
        user=engine_user,
        capture_output=True,
        text=True,
        cwd="/",
        env={"PATH": "/usr/bin:/bin", "HOME": "/"},
        timeout=120,
    )
    if r.returncode != 0:
        pytest.skip(
            f"{engine_user} cannot run {engine_venv} (made from {_base_python()}): "
            f"{r.stderr.strip()[-300:]}; install a Python {sys.version_info.major}."
            f"{sys.version_info.minor} outside /root (apt-get install python3) to run this test"
        )
    return engine_venv
