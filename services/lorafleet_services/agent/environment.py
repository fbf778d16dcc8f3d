"""The trainer's environment on a node: which Python trains, the pinned
overlay it imports peft and accelerate from, the user it runs as, and the
clean process environment it gets.

- Python: `cfg.python`, else the newest `<engines_dir>/vllm/<version>/bin/python3`
  (its torch already matches the node's CUDA). No second environment.
- Overlay: `cfg.overlay_packages` installed `--no-deps --target` into
  `work_dir/overlay-<key>`, key = hash of (python path, its version, pins);
  built in `overlay-<key>.partial`, marked complete last, renamed into place.
  A directory named `overlay-<key>` with its marker is a whole overlay; nothing
  else is ever taken for one. See docs/agent-environment.md.
- User: the engines' unprivileged user, with a home of its own under work_dir;
  the agent runs the trainer as itself (and says so) when it cannot.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import grp
import hashlib
import json
import os
import pwd
import re
import shutil
import stat
import sys
import tempfile
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from lorafleet import log
from lorafleet.log import Event
from lorafleet_services.agent.cards import CardChoice
from lorafleet_services.agent.config import AgentConfig, EngineUser
from lorafleet_services.agent.process import run_process

#: Inside a complete overlay; written last, before the rename.
OVERLAY_MARKER = ".lorafleet-overlay.json"
#: In work_dir: serialises overlay builds between agents on one node.
OVERLAY_LOCK = ".overlay.lock"
#: Seconds an installer may run (a slow index, a cold cache) before it is killed.
INSTALL_TIMEOUT_S = 900.0
#: Seconds the interpreter probe and the import check may take (the check
#: imports torch, which is slow on a cold page cache).
PROBE_TIMEOUT_S = 60.0
CHECK_TIMEOUT_S = 300.0
#: Seconds an installer or probe stopped at its timeout gets between SIGTERM and SIGKILL.
STOP_GRACE_S = 2.0
#: Seconds between tries of another agent's overlay lock.
LOCK_POLL_S = 0.1
#: The trainer's PATH after its interpreter's own bin directory.
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: The groups the engines' user needs for the GPU device nodes.
DEVICE_GROUPS = ("video", "render")

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

_PIN = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s;,]+)\s*$")

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


class TrainerEnvironment(Protocol):
    """What a trainer (and the GGUF converter) runs in: its Python, its user,
    its process environment. `EngineEnvironment` is the node's engine Python,
    `StandinEnvironment` the stand-in trainer's."""

    @property
    def python(self) -> str: ...

    @property
    def user(self) -> EngineUser | None: ...

    @property
    def notes(self) -> tuple[str, ...]: ...

    def process_env(
        self, choice: CardChoice, extra: Mapping[str, str] | None = None
    ) -> dict[str, str]: ...

    def give(self, path: Path) -> None: ...


#: In every trainer's and converter's environment, whatever runs it: lines
#: unbuffered (the agent reads them as they come), no progress bars and no
#: tokenizer threads in the output, and a CUDA allocator that returns
#: memory a co-located engine may need.
RUN_ENV: Mapping[str, str] = {
    "PYTHONUNBUFFERED": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
}


class TrainerSetupError(RuntimeError):
    """The node cannot run the trainer as configured; the message says what
    to install or change."""


@dataclass(frozen=True)
class EngineEnvironment:
    """The node's engine Python, prepared to train (a TrainerEnvironment)."""

    #: The interpreter that trains.
    python: str
    #: The overlay directory (first); nothing of lorafleet's.
    pythonpath: tuple[str, ...]
    #: None: runs as the agent's own user.
    user: EngineUser | None
    #: The trainer's home (its caches).
    home: Path
    #: HF_HOME: cfg.hf_home (shared with the engines), or under home.
    hf_home: Path
    #: What the job's log and message should say (each says how to fix it).
    notes: tuple[str, ...]
    #: HF_HUB_OFFLINE=1 for the trainer; default False.
    hf_offline: bool = False

    def process_env(
        self, choice: CardChoice, extra: Mapping[str, str] | None = None
    ) -> dict[str, str]:
        """The trainer's whole environment, built from nothing (the agent's
        own never leaks in: no LORAFLEET_*, no virtualenv, no proxy secrets).
        `extra` is added last and wins."""
        who = (self.user or _self_user(self.home)).env()
        env = {
            "PATH": f"{Path(self.python).parent}:{SYSTEM_PATH}",
            "LANG": os.environ.get("LANG") or "C.UTF-8",
            "PYTHONNOUSERSITE": "1",
            **RUN_ENV,
            **who,
            "HF_HOME": str(self.hf_home),
            # NVML numbers cards in PCI bus order; CUDA's default order is
            # fastest first, so without this the index could name another card.
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            "CUDA_VISIBLE_DEVICES": "" if choice.index is None else str(choice.index),
        }
        if self.pythonpath:
            env["PYTHONPATH"] = os.pathsep.join(self.pythonpath)
        if self.hf_offline:
            env["HF_HUB_OFFLINE"] = "1"
        env.update(extra or {})
        return env

    def give(self, path: Path) -> None:
        """Hand `path` and everything under it to the trainer's user (no-op
        when the trainer runs as the agent)."""
        if self.user is not None:
            _chown_tree(path, self.user.uid, self.user.gid)


@dataclass(slots=True)
class StandinEnvironment:
    """The stand-in trainer's environment (a TrainerEnvironment): the agent's
    own Python and user.

    The LORAFLEET_STANDIN_* knobs reach the trainer from the agent's
    environment; the agent's other LORAFLEET_* settings do not.
    """

    python: str = sys.executable
    user: EngineUser | None = None
    notes: tuple[str, ...] = ()
    base_env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))

    def process_env(
        self, choice: CardChoice, extra: Mapping[str, str] | None = None
    ) -> dict[str, str]:
        env = {
            k: v
            for k, v in self.base_env.items()
            if not k.startswith("LORAFLEET_") or k.startswith("LORAFLEET_STANDIN_")
        }
        env.update(RUN_ENV)
        env["CUDA_VISIBLE_DEVICES"] = "" if choice.index is None else str(choice.index)
        env.update(extra or {})
        return env

    def give(self, path: Path) -> None:
        return None


# --------------------------------------------------------------------- Python


def _version_key(name: str) -> tuple[tuple[int, ...], int, str]:
    """Orders vLLM version directories as versions: 0.11.0 > 0.9.2, and a
    release after its own pre-releases (0.11.0 > 0.11.0rc1)."""
    m = re.match(r"^v?(\d+(?:\.\d+)*)(.*)$", name)
    if m is None:
        return ((), 0, name)
    release = tuple(int(p) for p in m.group(1).split("."))
    while len(release) > 1 and release[-1] == 0:
        release = release[:-1]
    rest = m.group(2)
    # "+cu128" / "-cu128" are builds of the release; anything else (rc1, .dev0) comes before it.
    final = 1 if rest == "" or rest[0] in "+-" else 0
    return (release, final, rest)


def find_python(cfg: AgentConfig) -> str:
    """cfg.python (a path, or a name on PATH); else the newest
    `<engines_dir>/vllm/<version>/bin/python3`; else TrainerSetupError."""
    if cfg.python:
        found = cfg.python if os.sep in cfg.python else shutil.which(cfg.python)
        if found is None or not os.access(found, os.X_OK) or os.path.isdir(found):
            raise TrainerSetupError(
                f"the trainer's Python {cfg.python!r} (LORAFLEET_AGENT_PYTHON) is not an "
                "executable here; point it at an interpreter with torch and transformers, "
                "or unset it to use the newest vLLM's"
            )
        return found
    root = cfg.engines_dir / "vllm"
    candidates = []
    with contextlib.suppress(OSError):
        for d in root.iterdir():
            py = d / "bin" / "python3"
            if d.is_dir() and py.is_file() and os.access(py, os.X_OK):
                candidates.append((_version_key(d.name), str(py)))
    if not candidates:
        raise TrainerSetupError(
            f"training needs vLLM installed on this node (its torch is what trains) and "
            f"there is none under {root}: install one as <engines_dir>/vllm/<version> "
            "(serving any vLLM model here installs it), or set LORAFLEET_AGENT_PYTHON to an "
            "interpreter with torch and transformers"
        )
    return max(candidates)[1]


# -------------------------------------------------------------------- overlay


def _pins(pins: Sequence[str]) -> dict[str, str]:
    """{distribution: version} of exact pins; a pin that is not `name==version` is left out."""
    out = {}
    for p in pins:
        m = _PIN.match(p)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def _module_name(dist: str) -> str:
    return dist.lower().replace("-", "_").replace(".", "_")


def find_uv(cfg: AgentConfig) -> str | None:
    """The node's uv: the newest `engines_dir/uv/**/uv`, else `uv` on PATH, else None."""
    found: list[tuple[tuple[tuple[tuple[int, ...], int, str], ...], str]] = []
    root = cfg.engines_dir / "uv"
    if root.is_dir():
        for dirpath, _dirs, files in os.walk(root):
            if "uv" in files:
                p = Path(dirpath) / "uv"
                if os.access(p, os.X_OK):
                    key = tuple(_version_key(part) for part in p.relative_to(root).parts)
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


def _plain_env(home: str) -> dict[str, str]:
    """A minimal environment for probing an interpreter."""
    return {
        "PATH": SYSTEM_PATH,
        "LANG": "C.UTF-8",
        "HOME": home,
        "PYTHONNOUSERSITE": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "CUDA_VISIBLE_DEVICES": "",
    }


async def _run(
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: Path,
    timeout_s: float,
    user: EngineUser | None = None,
) -> tuple[int, list[str], str]:
    """(returncode, stdout lines, the last lines of stdout and stderr);
    returncode -1 when it ran past timeout_s and was killed."""
    lines: deque[str] = deque(maxlen=400)

    async def keep(line: bytes) -> None:
        lines.append(line.decode(errors="replace"))

    try:
        res = await asyncio.wait_for(
            run_process(argv, env=env, cwd=cwd, user=user, on_line=keep, grace_s=STOP_GRACE_S),
            timeout_s,
        )
    except TimeoutError:
        return -1, list(lines), f"killed after {timeout_s:.0f} s"
    tail = [ln for ln in list(lines)[-3:] if ln.strip()]
    if res.stderr_tail:
        tail.append(res.stderr_tail)
    return res.returncode, list(lines), " | ".join(tail)


async def _probe(python: str, names: Sequence[str], cwd: Path) -> dict[str, object]:
    with tempfile.TemporaryDirectory(dir=cwd, prefix=".probe-") as home:
        try:
            rc, out, tail = await _run(
                [python, "-c", _PROBE, *names],
                env=_plain_env(home),
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


_locks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = (
    weakref.WeakKeyDictionary()
)


def _loop_lock() -> asyncio.Lock:
    loop = asyncio.get_running_loop()
    lock = _locks.get(loop)
    if lock is None:
        lock = _locks[loop] = asyncio.Lock()
    return lock


@contextlib.asynccontextmanager
async def _file_lock(path: Path) -> AsyncIterator[None]:
    """An exclusive flock on `path`, waited for without blocking the event
    loop and given up cleanly when the waiting task is cancelled."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                await asyncio.sleep(LOCK_POLL_S)
        yield
    finally:
        os.close(fd)  # releases the lock


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
    async with _loop_lock(), _file_lock(cfg.work_dir / OVERLAY_LOCK):
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
        rc, _out, tail = await _run(
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
    names = [n for n in pins] or [
        re.split(r"[<>=!~;\[ ]", p, maxsplit=1)[0] for p in cfg.overlay_packages
    ]
    args = [a for n in names for a in (n, _module_name(n))]
    with tempfile.TemporaryDirectory(dir=cfg.work_dir, prefix=".check-") as home:
        env = {**_plain_env(home), "PYTHONPATH": str(overlay)}
        rc, out, tail = await _run(
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


# ----------------------------------------------------------------------- user


def _fix_user(name: str) -> str:
    return f"useradd --system --shell /usr/sbin/nologin {name} && usermod -aG video,render {name}"


def _chown_tree(path: Path, uid: int, gid: int) -> None:
    os.lchown(path, uid, gid)
    for dirpath, dirs, files in os.walk(path):
        for n in (*dirs, *files):
            os.lchown(os.path.join(dirpath, n), uid, gid)


def _passable(path: Path, uid: int, groups: Sequence[int]) -> bool:
    st = path.stat()
    if st.st_uid == uid:
        return bool(st.st_mode & stat.S_IXUSR)
    if st.st_gid in groups:
        return bool(st.st_mode & stat.S_IXGRP)
    return bool(st.st_mode & stat.S_IXOTH)


def _self_user(home: Path) -> EngineUser:
    """The agent's own identity, with the trainer's home."""
    uid, gid = os.geteuid(), os.getegid()
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        name = str(uid)
    return EngineUser(name=name, uid=uid, gid=gid, groups=tuple(os.getgroups()), home=home)


def resolve_user(cfg: AgentConfig) -> tuple[EngineUser | None, str]:
    """(the engines' user, "") with its home made under work_dir (0700, its
    own) and work_dir passable (0751); or (None, why the trainer runs as the
    agent, with how to fix it). why is "" when there is nothing to fix."""
    name = cfg.run_as
    home = cfg.work_dir / "engine-home"
    me = _self_user(home).name
    if os.geteuid() != 0:
        if name in ("", me):
            return None, ""
        return None, (
            f"runs as {me}: the agent is not root, so it cannot switch to {name}; "
            "run the agent as root to train as the engines' user"
        )
    if name in ("", "root"):
        return None, (
            f"runs as root: LORAFLEET_AGENT_RUN_AS is {name!r}; set it to the engines' "
            "unprivileged user (default lorafleet-engine)"
        )
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        return None, f"runs as root: there is no user {name} ({_fix_user(name)} to fix)"
    if pw.pw_uid == 0:
        return None, f"runs as root: {name} is uid 0; make it an unprivileged user"
    groups = tuple(sorted(set(os.getgrouplist(name, pw.pw_gid))))
    try:
        cfg.work_dir.mkdir(parents=True, exist_ok=True)
        work = cfg.work_dir.resolve()
        for parent in reversed(work.parents):
            if not _passable(parent, pw.pw_uid, groups):
                return None, (
                    f"runs as root: {name} cannot pass through {parent} "
                    f"(mode {stat.S_IMODE(parent.stat().st_mode):04o}) to reach {work}; "
                    f"chmod o+x {parent}, or put the work directory elsewhere"
                )
        os.chmod(work, 0o751)
        home.mkdir(mode=0o700, exist_ok=True)
        os.chmod(home, 0o700)
        if home.stat().st_uid != pw.pw_uid:
            # New, or made while the trainer ran as root: its caches become the user's.
            _chown_tree(home, pw.pw_uid, pw.pw_gid)
    except OSError as e:
        return None, f"runs as root: preparing {name}'s home {home} failed: {e}"
    return EngineUser(name=name, uid=pw.pw_uid, gid=pw.pw_gid, groups=groups, home=home), ""


def _group_note(user: EngineUser) -> str:
    missing = []
    for g in DEVICE_GROUPS:
        try:
            gid = grp.getgrnam(g).gr_gid
        except KeyError:
            continue  # this node has no such group; nothing to join
        if gid not in user.groups:
            missing.append(g)
    if not missing:
        return ""
    return (
        f"{user.name} is not in the {' and '.join(missing)} group(s), which may keep it from "
        f"the GPU devices: usermod -aG {','.join(missing)} {user.name}"
    )


async def _user_can_run(python: str, user: EngineUser) -> str:
    """ "" when `user` can start `python`; else why not."""
    env = {**_plain_env(str(user.home)), **user.env()}
    try:
        rc, _out, tail = await _run(
            [python, "-c", "import site"],
            env=env,
            cwd=user.home,
            user=user,
            timeout_s=PROBE_TIMEOUT_S,
        )
    except OSError as e:
        return str(e)
    return "" if rc == 0 else (tail or f"exit {rc}")


# -------------------------------------------------------------------- prepare


async def prepare(cfg: AgentConfig) -> EngineEnvironment:
    """Find the Python, make sure its overlay is there, and settle the user.
    Raises TrainerSetupError when the node cannot train (no Python, the
    overlay does not install or import)."""
    python = find_python(cfg)
    user, why = await asyncio.to_thread(resolve_user, cfg)  # may chown a home of caches
    notes = [why] if why else []
    if user is not None:
        cannot = await _user_can_run(python, user)
        if cannot:
            notes.append(
                f"runs as root: {user.name} cannot run {python} ({cannot}); make the "
                f"interpreter and its directories readable by {user.name}"
            )
            user = None
        elif note := _group_note(user):
            notes.append(note)
    overlay = await ensure_overlay(cfg, python)
    home = user.home if user is not None else cfg.work_dir / "engine-home"
    if user is None:
        home.mkdir(parents=True, exist_ok=True)
    hf_home = Path(cfg.hf_home) if cfg.hf_home else home / ".cache" / "huggingface"
    return EngineEnvironment(
        python=python,
        pythonpath=(str(overlay),),
        user=user,
        home=home,
        hf_home=hf_home,
        notes=tuple(notes),
        hf_offline=cfg.hf_offline,
    )


__all__ = [
    "EngineEnvironment",
    "StandinEnvironment",
    "TrainerEnvironment",
    "TrainerSetupError",
    "ensure_overlay",
    "find_python",
    "find_uv",
    "prepare",
    "resolve_user",
]
