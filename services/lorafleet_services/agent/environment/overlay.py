"""The trainer's overlay: `cfg.overlay_packages` (peft and accelerate,
pinned) installed `--no-deps --target` into `work_dir/overlay-<key>`, key =
hash of (python path, its version, pins), for the engine's Python to import
them from (first on its PYTHONPATH).

Built in `overlay-<key>.partial-*`, marked complete last, renamed into
place: a directory named `overlay-<key>` with its marker is a whole overlay;
nothing else is ever taken for one. One build at a time per work directory,
in this process or another agent's (a `filelock` on OVERLAY_LOCK, polled
off the event loop).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from filelock import AsyncFileLock
from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import Version

from lorafleet import log
from lorafleet.log import Event
from lorafleet_services.agent.config import AgentConfig
from lorafleet_services.agent.environment.protocol import TrainerSetupError
from lorafleet_services.agent.environment.setup_runs import PROBE_TIMEOUT_S, plain_env, run_helper
from lorafleet_services.agent.node.installed_engines import version_order

#: Inside a complete overlay; written last, before the rename.
OVERLAY_MARKER = ".lorafleet-overlay.json"
#: In work_dir: serialises overlay builds between agents on one node.
OVERLAY_LOCK = ".overlay.lock"
#: Seconds an installer may run (a slow index, a cold cache) before it is killed.
INSTALL_TIMEOUT_S = 900.0
#: Seconds the import check may take (it imports torch, which is slow on a
#: cold page cache).
CHECK_TIMEOUT_S = 300.0
#: Seconds between tries of another agent's overlay lock.
LOCK_POLL_S = 0.1

#: Variables that would point an installer at another environment than the
#: engine's Python.
_INSTALLER_DROP = {
    "PYTHONPATH",
    "PYTHONHOME",
    "PYTHONSTARTUP",
    "VIRTUAL_ENV",
    "CONDA_PREFIX",
    "PIP_TARGET",
    "PIP_PREFIX",
    "PIP_USER",
    "UV_PROJECT_ENVIRONMENT",
}

_PROBE = """\
import importlib.metadata as m, json, sys
def v(n):
    try:
        return m.version(n)
    except m.PackageNotFoundError:
        return None
print(json.dumps({"version": sys.version.split()[0], "tag": sys.implementation.cache_tag,
                  "have": {n: v(n) for n in sys.argv[1:]}}))
"""

_CHECK = """\
import importlib, importlib.metadata as m, json, sys
out = {}
for dist, mod in zip(sys.argv[1::2], sys.argv[2::2]):
    module = importlib.import_module(mod)
    out[dist] = {"version": m.version(dist), "file": getattr(module, "__file__", None) or ""}
print(json.dumps(out))
"""


def _pins(pins: Sequence[str]) -> dict[str, str]:
    """{distribution: version} of exact pins; a pin that is not `name==version`
    (a range, a wildcard, extras, a marker, a URL) is left out."""
    out = {}
    for p in pins:
        try:
            req = Requirement(p)
        except InvalidRequirement:
            continue
        specs = list(req.specifier)
        exact = len(specs) == 1 and specs[0].operator == "==" and "*" not in specs[0].version
        if exact and not req.extras and req.marker is None and req.url is None:
            out[req.name] = specs[0].version
    return out


def _distribution(pin: str) -> str:
    """The distribution a requirement names (the whole text when it does not parse)."""
    try:
        return Requirement(pin).name
    except InvalidRequirement:
        return pin.strip()


def _module_name(dist: str) -> str:
    return dist.lower().replace("-", "_").replace(".", "_")


def find_uv(cfg: AgentConfig) -> str | None:
    """The node's uv: the newest `engines_dir/uv/**/uv`, else `uv` on PATH, else None."""
    found: list[tuple[tuple[tuple[int, Version | str], ...], str]] = []
    root = cfg.engines_dir / "uv"
    if root.is_dir():
        for dirpath, _dirs, files in os.walk(root):
            if "uv" in files:
                p = Path(dirpath) / "uv"
                if os.access(p, os.X_OK):
                    key = tuple(version_order(part) for part in p.relative_to(root).parts)
                    found.append((key, str(p)))
    if found:
        return max(found)[1]
    return shutil.which("uv")


def _installer_env() -> dict[str, str]:
    """The agent's environment (proxy and index settings reach the installer)
    without anything that points at another Python environment."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _INSTALLER_DROP and not k.startswith("LORAFLEET_")
    }
    env.update(
        PYTHONNOUSERSITE="1",
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        PIP_NO_INPUT="1",
        UV_PYTHON_DOWNLOADS="never",
        UV_NO_PROGRESS="1",
    )
    return env


async def _probe(python: str, names: Sequence[str], cwd: Path) -> dict[str, object]:
    with tempfile.TemporaryDirectory(dir=cwd, prefix=".probe-") as home:
        try:
            rc, out, tail = await run_helper(
                [python, "-c", _PROBE, *names],
                env=plain_env(home),
                cwd=cwd,
                timeout_s=PROBE_TIMEOUT_S,
            )
        except OSError as e:
            raise TrainerSetupError(f"cannot run the trainer's Python {python}: {e}") from None
    if rc != 0 or not out:
        raise TrainerSetupError(f"the trainer's Python {python} does not run: {tail or rc}")
    try:
        info = json.loads(out[-1])
    except ValueError:
        raise TrainerSetupError(f"the trainer's Python {python} answered {out[-1]!r}") from None
    if not isinstance(info, dict):
        raise TrainerSetupError(f"the trainer's Python {python} answered {out[-1]!r}")
    return info


def _read_marker(d: Path) -> dict[str, object] | None:
    try:
        data = json.loads((d / OVERLAY_MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _make_readable(root: Path) -> None:
    """Directories 0755, files 0644 (0755 if executable): the engines' user
    reads what root installed. fsyncs each file, so that the marker, written
    after, never describes files still only in the page cache."""
    os.chmod(root, 0o755)
    for dirpath, dirs, files in os.walk(root):
        for d in dirs:
            p = os.path.join(dirpath, d)
            if not os.path.islink(p):
                os.chmod(p, 0o755)
        for f in files:
            p = os.path.join(dirpath, f)
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                continue
            os.chmod(p, 0o755 if st.st_mode & stat.S_IXUSR else 0o644)
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_marker(d: Path, data: Mapping[str, object]) -> None:
    part = d / (OVERLAY_MARKER + ".part")
    with open(part, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(part, 0o644)
    os.rename(part, d / OVERLAY_MARKER)
    _fsync_dir(d)


def _clear_leftovers(target: Path) -> None:
    """Leftovers of a crash: partial builds, or a directory never marked complete.
    Each build has its own partial name: an installer orphaned by a crashed
    agent may still write into its old one."""
    for old in target.parent.glob(f"{target.name}.partial-*"):
        shutil.rmtree(old, ignore_errors=True)
    shutil.rmtree(target, ignore_errors=True)


def _complete(partial: Path, target: Path, marker: Mapping[str, object]) -> None:
    """Readable by all, on disk, marked complete (last), renamed into place."""
    _make_readable(partial)
    _write_marker(partial, marker)
    os.rename(partial, target)
    _fsync_dir(target.parent)


def overlay_dir(cfg: AgentConfig, python: str, python_version: str, tag: str) -> Path:
    """Where the overlay for this interpreter and pin set lives."""
    key = "\0".join([python, python_version, tag, *sorted(cfg.overlay_packages)])
    return cfg.work_dir / f"overlay-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


async def ensure_overlay(cfg: AgentConfig, python: str) -> Path:
    """The overlay directory for `python` and cfg.overlay_packages, installed
    if it is not there yet. Once per interpreter and pin set; concurrent calls
    (in this process or another agent's) wait for one install. Raises
    TrainerSetupError with the installer's last lines when it fails."""
    cfg.work_dir.mkdir(parents=True, exist_ok=True)
    pins = _pins(cfg.overlay_packages)
    info = await _probe(python, list(pins), cfg.work_dir)
    version, tag = str(info["version"]), str(info["tag"])
    target = overlay_dir(cfg, python, version, tag)
    if _read_marker(target) is not None:
        return target
    async with AsyncFileLock(cfg.work_dir / OVERLAY_LOCK, poll_interval=LOCK_POLL_S):
        if _read_marker(target) is not None:  # another agent built it while we waited
            return target
        await asyncio.to_thread(_clear_leftovers, target)
        partial = target.with_name(f"{target.name}.partial-{os.getpid()}-{os.urandom(3).hex()}")
        partial.mkdir(mode=0o755)
        try:
            started = time.monotonic()
            have = info.get("have")
            exact = len(pins) == len(cfg.overlay_packages)
            satisfied = (
                exact and isinstance(have, dict) and all(have.get(n) == v for n, v in pins.items())
            )
            # An interpreter that already has exactly the pins needs nothing on top
            # (the embedded default: the project's own Python); the overlay stays empty.
            # Its own pip resolved them against its torch and transformers, so the
            # import check (seconds: it imports torch) is spared on this path, which
            # every fresh work directory of the embedded default takes.
            if satisfied:
                installer = "none: the interpreter has them"
                found = dict(pins)
            else:
                installer = await _install(cfg, python, partial)
                found = await _check(cfg, python, partial, pins)
            marker = {
                "python": python,
                "python_version": version,
                "pins": list(cfg.overlay_packages),
                "versions": found,
                "installer": installer,
                "created_at": time.time(),
            }
            # Off the event loop: hundreds of chmods and fsyncs would stall heartbeats.
            await asyncio.to_thread(_complete, partial, target, marker)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
    log.get().info(
        Event.OVERLAY_INSTALLED,
        python=python,
        dir=str(target),
        versions=found,
        installer=installer,
        wall_s=round(time.monotonic() - started, 2),
    )
    return target


async def _install(cfg: AgentConfig, python: str, into: Path) -> str:
    uv = find_uv(cfg)
    source = ["--no-index", "--find-links", str(cfg.wheel_dir)] if cfg.wheel_dir else []
    if uv is not None:
        argv = [uv, "pip", "install", "--python", python, "--no-deps", "--target", str(into)]
        argv += ["--compile-bytecode", *source, *cfg.overlay_packages]
        name = f"uv ({uv})"
    else:
        argv = [python, "-m", "pip", "install", "--no-deps", "--target", str(into)]
        argv += ["--disable-pip-version-check", "--no-input", *source, *cfg.overlay_packages]
        name = f"pip ({python} -m pip)"
    try:
        rc, _out, tail = await run_helper(
            argv, env=_installer_env(), cwd=cfg.work_dir, timeout_s=INSTALL_TIMEOUT_S
        )
    except OSError as e:
        rc, tail = 127, str(e)
    if rc != 0:
        hint = (
            f"; is {cfg.wheel_dir} (LORAFLEET_AGENT_WHEEL_DIR) a directory of these wheels? "
            f"pip download --no-deps {' '.join(cfg.overlay_packages)} -d {cfg.wheel_dir}"
            if cfg.wheel_dir
            else "; on a node without an index, set LORAFLEET_AGENT_WHEEL_DIR to a directory "
            f"made with: pip download --no-deps {' '.join(cfg.overlay_packages)} -d DIR"
        )
        if uv is None and "No module named pip" in tail:
            hint = (
                f"; {python} has no pip: put uv under {cfg.engines_dir / 'uv'} or on PATH, "
                "or install pip into that Python"
            )
        raise TrainerSetupError(
            f"installing {', '.join(cfg.overlay_packages)} for {python} with {name} failed "
            f"(exit {rc}): {tail}{hint}"
        )
    return name


async def _check(
    cfg: AgentConfig, python: str, overlay: Path, pins: Mapping[str, str]
) -> dict[str, str]:
    """Imports each pinned package in `python` with only the overlay on
    PYTHONPATH; answers {name: version}. Each must come from the overlay, at
    its pinned version."""
    names = [n for n in pins] or [_distribution(p) for p in cfg.overlay_packages]
    args = [a for n in names for a in (n, _module_name(n))]
    with tempfile.TemporaryDirectory(dir=cfg.work_dir, prefix=".check-") as home:
        env = {**plain_env(home), "PYTHONPATH": str(overlay)}
        rc, out, tail = await run_helper(
            [python, "-c", _CHECK, *args], env=env, cwd=cfg.work_dir, timeout_s=CHECK_TIMEOUT_S
        )
    if rc != 0 or not out:
        raise TrainerSetupError(
            f"{', '.join(names)} do not import in {python} with the overlay: {tail}; "
            "the pins may not fit that Python's torch/transformers (change the pins, or the vLLM)"
        )
    got = json.loads(out[-1])
    versions: dict[str, str] = {}
    for n in names:
        v, f = str(got[n]["version"]), str(got[n]["file"])
        versions[n] = v
        if not Path(f).resolve().is_relative_to(overlay.resolve()):
            raise TrainerSetupError(f"{n} imports from {f}, not from the overlay {overlay}")
        if n in pins and v != pins[n]:
            raise TrainerSetupError(f"{n} is {v} in the overlay for {python}, not {pins[n]}")
    return versions
