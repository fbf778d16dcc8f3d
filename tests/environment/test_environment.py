"""The trainer's environment: the Python it finds, the overlay it installs
(really, from a local wheel directory, with pip and with uv), the user it
runs as, and the environment it hands the trainer."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from lorafleet_services.agent.config import AgentConfig, EngineUser
from lorafleet_services.agent.environment.engines_user import resolve_user
from lorafleet_services.agent.environment.environments import (
    EngineEnvironment,
    find_python,
    prepare,
)
from lorafleet_services.agent.environment.overlay import OVERLAY_MARKER, ensure_overlay, overlay_dir
from lorafleet_services.agent.environment.protocol import TrainerSetupError
from lorafleet_services.agent.node.cards import CardChoice
from lorafleet_services.agent.node.process import run_process
from tests.environment.conftest import Engines, make_engines
from tests.eventually import eventually

CPU = CardChoice(index=None, name="cpu", free_mib=0)

#: Run in the trainer's environment: which peft and accelerate it imports.
IMPORTS = (
    "import json, peft, accelerate; print(json.dumps({'peft': [peft.__version__, peft.__file__], "
    "'accelerate': [accelerate.__version__, accelerate.__file__]}))"
)


def _cfg(engines: Path, work: Path, **kw: object) -> AgentConfig:
    return AgentConfig(node="n1", engines_dir=engines, work_dir=work, **kw)  # type: ignore[arg-type]


def _overlays(work: Path) -> list[str]:
    return sorted(p.name for p in work.glob("overlay-*"))


async def _imports(env: EngineEnvironment) -> dict[str, list[str]]:
    lines: list[bytes] = []

    async def keep(line: bytes) -> None:
        lines.append(line)

    res = await run_process(
        [env.python, "-c", IMPORTS],
        env=env.process_env(CPU),
        cwd=env.home,
        user=env.user,
        on_line=keep,
    )
    assert res.returncode == 0, res.stderr_tail
    out: dict[str, list[str]] = json.loads(lines[-1])
    return out


# ------------------------------------------------------------------- Python


def test_find_python_newest_vllm_by_version_not_string(tmp_path: Path) -> None:
    for v in ("0.9.2", "0.11.0", "0.11.0rc1", "0.10.10"):
        py = tmp_path / "vllm" / v / "bin" / "python3"
        py.parent.mkdir(parents=True)
        py.write_text("#!/bin/sh\n")
        py.chmod(0o755)
    (tmp_path / "vllm" / "0.12.0").mkdir()  # no interpreter: not an install
    cfg = _cfg(tmp_path, tmp_path / "work")
    assert find_python(cfg) == str(tmp_path / "vllm" / "0.11.0" / "bin" / "python3")
    assert find_python(cfg.with_(python=sys.executable)) == sys.executable


def test_no_vllm_and_no_python_says_how_to_install(tmp_path: Path) -> None:
    with pytest.raises(TrainerSetupError, match=r"vLLM.*vllm/<version>.*LORAFLEET_AGENT_PYTHON"):
        find_python(_cfg(tmp_path / "engines", tmp_path / "work"))
    with pytest.raises(TrainerSetupError, match="LORAFLEET_AGENT_PYTHON"):
        find_python(_cfg(tmp_path, tmp_path, python=str(tmp_path / "nope" / "python3")))


# -------------------------------------------------------------- process_env


def test_process_env_is_clean_and_names_the_card(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LORAFLEET_AGENT_NODE", "n1")
    monkeypatch.setenv("LORAFLEET_NATS_URL", "nats://secret@host")
    monkeypatch.setenv("VIRTUAL_ENV", "/srv/lorafleet/.venv")
    monkeypatch.setenv("PYTHONPATH", "/agent/only")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    user = EngineUser("eng", 999, 998, (998, 44), tmp_path / "engine-home")
    env = EngineEnvironment(
        python="/opt/e/vllm/0.11.0/bin/python3",
        pythonpath=("/w/overlay-1",),
        user=user,
        home=user.home,
        hf_home=Path("/shared/hf"),
        notes=(),
        hf_offline=True,
    )
    card = env.process_env(CardChoice(index=3, name="H200", free_mib=100_000), {"EXTRA": "1"})
    assert not [k for k in card if k.startswith("LORAFLEET_")]
    assert "VIRTUAL_ENV" not in card and "AWS_SECRET_ACCESS_KEY" not in card
    assert "/srv/lorafleet/.venv" not in json.dumps(card)
    assert card["PYTHONPATH"] == "/w/overlay-1"
    # The operator's thread count reaches the trainer; one not set is not made up.
    assert card["OMP_NUM_THREADS"] == "3" and "MKL_NUM_THREADS" not in card
    assert card["PATH"].split(":")[0] == "/opt/e/vllm/0.11.0/bin"
    assert card["CUDA_VISIBLE_DEVICES"] == "3"
    assert card["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert card["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert card["PYTHONUNBUFFERED"] == "1" and card["PYTHONNOUSERSITE"] == "1"
    assert card["HF_HOME"] == "/shared/hf" and card["HF_HUB_OFFLINE"] == "1"
    assert card["HOME"] == str(user.home) and card["USER"] == "eng"
    assert card["XDG_CACHE_HOME"] == str(user.home / ".cache")
    assert card["TRITON_CACHE_DIR"] == str(user.home / ".cache" / "triton")
    assert card["EXTRA"] == "1"

    cpu = env.process_env(CPU)
    assert cpu["CUDA_VISIBLE_DEVICES"] == ""
    online = EngineEnvironment(
        python="/p/python3",
        pythonpath=(),
        user=None,
        home=tmp_path,
        hf_home=tmp_path / "hf",
        notes=(),
    ).process_env(CPU)
    assert "HF_HUB_OFFLINE" not in online and "PYTHONPATH" not in online
    assert online["HOME"] == str(tmp_path)


# --------------------------------------------------------------------- user


def test_missing_user_runs_as_itself_and_says_how_to_fix(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, tmp_path / "work", run_as="lorafleet-no-such-user")
    user, why = resolve_user(cfg)
    assert user is None
    if os.geteuid() == 0:
        assert "there is no user lorafleet-no-such-user" in why
        assert "useradd --system --shell /usr/sbin/nologin lorafleet-no-such-user" in why
        assert "usermod -aG video,render lorafleet-no-such-user" in why
    else:
        assert "not root" in why


def test_not_root_runs_as_itself(engine_user: str, user_engine_venv: Path, open_dir: Path) -> None:
    """Really not root: resolve_user run by the test user itself."""
    code = (
        "from pathlib import Path; from lorafleet_services.agent.config import AgentConfig; "
        "from lorafleet_services.agent.environment.engines_user import resolve_user; "
        "import json; "
        f"print(json.dumps(resolve_user(AgentConfig(node='n', work_dir=Path('{open_dir}/w-nr')))))"
    )
    r = subprocess.run(
        [str(user_engine_venv), "-c", code],
        user=engine_user,
        capture_output=True,
        text=True,
        cwd="/",
        env={"PATH": "/usr/bin:/bin", "HOME": "/"},
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    user, why = json.loads(r.stdout)
    assert user is None
    assert why.startswith(f"runs as {engine_user}: the agent is not root")
    assert "run the agent as root" in why


def test_a_work_dir_the_user_cannot_reach_runs_as_root(engine_user: str, tmp_path: Path) -> None:
    # tmp_path lies under pytest's 0700 directory of root's.
    user, why = resolve_user(_cfg(tmp_path, tmp_path / "work", run_as=engine_user))
    assert user is None
    assert f"{engine_user} cannot pass through" in why and "chmod o+x" in why


async def test_trainer_runs_as_the_engines_user(
    engine_user: str, user_engine_venv: Path, wheel_dir: Path, open_dir: Path
) -> None:
    engines = make_engines(open_dir / "e-user", user_engine_venv)
    work = open_dir / "w-user"
    # A hardened agent (systemd UMask=0077): what it installs must still be readable.
    umask = os.umask(0o077)
    try:
        env = await prepare(_cfg(engines.root, work, run_as=engine_user, wheel_dir=str(wheel_dir)))
    finally:
        os.umask(umask)
    assert env.user is not None and env.user.name == engine_user
    assert env.notes == ()
    assert env.home == work / "engine-home"
    assert stat.S_IMODE(env.home.stat().st_mode) == 0o700
    assert env.home.stat().st_uid == env.user.uid
    assert stat.S_IMODE(work.stat().st_mode) == 0o751

    job = work / "jobs" / "j1"
    job.mkdir(parents=True)
    (job / "job.json").write_text("{}")
    env.give(job)
    secret = open_dir / "root-only"
    secret.write_text("not for the trainer")
    secret.chmod(0o600)
    script = f"""
import json, os
os.makedirs(os.environ["HF_HOME"], exist_ok=True)
open("out.txt", "w").write("written by the trainer")
try:
    open({str(secret)!r}).read()
    secret = "read"
except PermissionError:
    secret = "denied"
print(json.dumps({{"uid": os.getuid(), "euid": os.geteuid(), "gid": os.getgid(),
    "groups": sorted(os.getgroups()), "home": os.environ["HOME"],
    "hf_home": os.environ["HF_HOME"], "xdg": os.environ["XDG_CACHE_HOME"],
    "cuda": os.environ["CUDA_VISIBLE_DEVICES"], "secret": secret,
    "hf_owner": os.stat(os.environ["HF_HOME"]).st_uid}}))
"""
    lines: list[bytes] = []

    async def keep(line: bytes) -> None:
        lines.append(line)

    res = await run_process(
        [env.python, "-c", script],
        env=env.process_env(CPU),
        cwd=job,
        user=env.user,
        on_line=keep,
    )
    assert res.returncode == 0, res.stderr_tail
    seen = json.loads(lines[-1])
    assert seen["uid"] == seen["euid"] == env.user.uid != 0
    assert seen["gid"] == env.user.gid
    assert set(seen["groups"]) == set(env.user.groups)
    assert seen["home"] == str(work / "engine-home")
    assert seen["hf_home"] == str(work / "engine-home" / ".cache" / "huggingface")
    assert seen["xdg"].startswith(seen["home"])
    assert seen["hf_owner"] == env.user.uid
    assert seen["cuda"] == ""
    assert seen["secret"] == "denied"
    assert (job / "out.txt").stat().st_uid == env.user.uid
    # The overlay it imports from is readable by it.
    got = await _imports(env)
    assert got["peft"][0] == "0.21.2" and got["peft"][1].startswith(env.pythonpath[0])


async def test_a_user_who_cannot_run_the_python_leaves_it_to_root(
    engine_user: str, tmp_path: Path, open_dir: Path
) -> None:
    """The project's own Python lives under /root (0700); it already has the
    pins, so its overlay is empty and nothing is downloaded."""
    work = open_dir / "w-own"
    cfg = _cfg(tmp_path, work, run_as=engine_user, python=sys.executable)
    env = await prepare(cfg)
    if env.user is not None:
        pytest.skip(f"{engine_user} can run {sys.executable} on this machine")
    assert any(f"{engine_user} cannot run {sys.executable}" in n for n in env.notes)
    (overlay,) = env.pythonpath
    marker = json.loads((Path(overlay) / OVERLAY_MARKER).read_text())
    assert marker["installer"].startswith("none")
    assert marker["versions"] == {"peft": "0.21.2", "accelerate": "1.15.0"}


# ------------------------------------------------------------------ overlay


def _kill_tree(proc: psutil.Process) -> None:
    kids = proc.children(recursive=True)
    for p in [proc, *kids]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGKILL)


async def _crash_mid_install(cfg: AgentConfig, python: str) -> None:
    """An agent process killed (with its installer) once the overlay's files
    are written but before it is marked complete."""
    agent = await _agent_process(cfg, python, stdout=asyncio.subprocess.DEVNULL)
    try:

        def written() -> list[Path]:
            assert agent.returncode is None, "the agent ended before the crash"
            return list(cfg.work_dir.glob("overlay-*.partial-*/peft/__init__.py"))

        await eventually(written, "the install to write peft", timeout_s=120, interval_s=0.02)
        _kill_tree(psutil.Process(agent.pid))
    finally:
        with contextlib.suppress(ProcessLookupError):
            agent.kill()
        await agent.wait()


async def _agent_process(cfg: AgentConfig, python: str, stdout: int) -> asyncio.subprocess.Process:
    """Another agent process on this node, building the overlay (prints its path)."""
    code = (
        "import asyncio, sys; from pathlib import Path; "
        "from lorafleet_services.agent.config import AgentConfig; "
        "from lorafleet_services.agent.environment.overlay import ensure_overlay; "
        "e, w, h, py = sys.argv[1:]; "
        "print(asyncio.run(ensure_overlay(AgentConfig(node='n2', engines_dir=Path(e), "
        "work_dir=Path(w), wheel_dir=h), py)))"
    )
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        code,
        str(cfg.engines_dir),
        str(cfg.work_dir),
        str(cfg.wheel_dir),
        python,
        stdout=stdout,
    )


async def test_overlay_from_wheels_with_pip_survives_a_crash_and_is_reused(
    engine_venv: Path, wheel_dir: Path, open_dir: Path, tmp_path: Path
) -> None:
    engines = make_engines(open_dir / "e-pip", engine_venv)
    work = open_dir / "w-pip"
    cfg = _cfg(engines.root, work, wheel_dir=str(wheel_dir), run_as="lorafleet-no-such-user")
    assert find_python(cfg) == str(engines.python)

    # Without the overlay the stand-in vLLM cannot import peft.
    bare = await asyncio.create_subprocess_exec(
        str(engines.python), "-c", "import peft", stderr=asyncio.subprocess.DEVNULL
    )
    assert await bare.wait() != 0

    # A wheel directory without the pins: a clear error, and nothing that looks installed.
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    with pytest.raises(TrainerSetupError, match=r"peft==0.21.2.*LORAFLEET_AGENT_WHEEL_DIR"):
        await ensure_overlay(cfg.with_(wheel_dir=str(empty)), str(engines.python))
    assert _overlays(work) == []

    await _crash_mid_install(cfg, str(engines.python))
    left = _overlays(work)
    assert len(left) == 1 and ".partial-" in left[0], left  # whole files, but not complete
    assert not list(work.glob(f"overlay-*/{OVERLAY_MARKER}"))

    log_before = engines.calls("-m pip install")
    env = await prepare(cfg)
    assert engines.calls("-m pip install") == log_before + 1
    (overlay,) = env.pythonpath
    assert _overlays(work) == [Path(overlay).name]  # the leftover is gone
    assert Path(overlay).parent == work
    assert env.python == str(engines.python)
    assert env.user is None
    if os.geteuid() == 0:
        assert any("useradd --system" in n for n in env.notes)

    got = await _imports(env)
    assert got["peft"][0] == "0.21.2" and got["accelerate"][0] == "1.15.0"
    assert got["peft"][1].startswith(overlay + "/") and got["accelerate"][1].startswith(overlay)
    marker = json.loads((Path(overlay) / OVERLAY_MARKER).read_text())
    assert marker["installer"].startswith("pip")
    for p in Path(overlay).rglob("*"):
        mode = stat.S_IMODE(p.lstat().st_mode)
        if p.is_dir():
            assert mode == 0o755, p
        elif not p.is_symlink():
            assert mode in (0o644, 0o755), p

    # A second job: the same overlay, untouched, no installer (the wheel dir is gone).
    before = (Path(overlay) / OVERLAY_MARKER).stat()
    again = await prepare(cfg.with_(wheel_dir=str(tmp_path / "gone")))
    assert again.pythonpath == env.pythonpath
    after = (Path(overlay) / OVERLAY_MARKER).stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert engines.calls("-m pip install") == log_before + 1


async def test_overlay_with_uv_is_installed_once_for_concurrent_agents(
    engine_venv: Path, wheel_dir: Path, uv_binary: Path, open_dir: Path
) -> None:
    engines: Engines = make_engines(open_dir / "e-uv", engine_venv, uv=uv_binary)
    work = open_dir / "w-uv"
    cfg = _cfg(engines.root, work, wheel_dir=str(wheel_dir))
    # Another agent process on the same node, and two jobs in this one, at once.
    other = await _agent_process(cfg, str(engines.python), stdout=asyncio.subprocess.PIPE)
    here = await asyncio.gather(
        ensure_overlay(cfg, str(engines.python)), ensure_overlay(cfg, str(engines.python))
    )
    out, _ = await other.communicate()
    assert other.returncode == 0
    assert here[0] == here[1] == Path(out.decode().splitlines()[-1])  # after any log line
    assert engines.calls("uv pip install") == 1  # uv, once, for all three
    assert engines.calls("-m pip install") == 0
    assert _overlays(work) == [here[0].name]
    marker = json.loads((here[0] / OVERLAY_MARKER).read_text())
    assert marker["installer"].startswith("uv")
    assert marker["versions"] == {"peft": "0.21.2", "accelerate": "1.15.0"}
    assert (here[0] / "peft" / "__init__.py").stat().st_mode & 0o777 == 0o644


async def test_the_overlay_is_keyed_by_pins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = overlay_dir(_cfg(tmp_path, tmp_path), "/py", "3.11.2", "cpython-311")
    b = overlay_dir(
        _cfg(tmp_path, tmp_path, overlay_packages=("peft==0.21.1", "accelerate==1.15.0")),
        "/py",
        "3.11.2",
        "cpython-311",
    )
    c = overlay_dir(_cfg(tmp_path, tmp_path), "/py", "3.11.3", "cpython-311")
    d = overlay_dir(_cfg(tmp_path, tmp_path), "/other/py", "3.11.2", "cpython-311")
    assert len({a, b, c, d}) == 4


async def test_a_python_without_pip_or_torch_fails_clearly(
    bare_python: Path, wheel_dir: Path, uv_binary: Path, open_dir: Path
) -> None:
    # No pip and no uv: say how to get an installer.
    engines = make_engines(open_dir / "e-bare", bare_python)
    cfg = _cfg(engines.root, open_dir / "w-bare", wheel_dir=str(wheel_dir), run_as="")
    with pytest.raises(TrainerSetupError, match=r"has no pip: put uv under .*/uv or on PATH"):
        await prepare(cfg)
    # With uv the wheels install, but peft cannot import without torch: refused, nothing kept.
    engines = make_engines(open_dir / "e-bare-uv", bare_python, uv=uv_binary)
    cfg = cfg.with_(engines_dir=engines.root)
    with pytest.raises(
        TrainerSetupError, match=r"do not import in .*No module named '(torch|transformers)'"
    ):
        await prepare(cfg)
    assert engines.calls("uv pip install") == 1
    assert _overlays(cfg.work_dir) == []


async def test_a_cancelled_install_leaves_no_installer_and_no_partial(
    engine_venv: Path, wheel_dir: Path, open_dir: Path
) -> None:
    engines = make_engines(open_dir / "e-cancel", engine_venv)
    cfg = _cfg(engines.root, open_dir / "w-cancel", wheel_dir=str(wheel_dir))
    task = asyncio.create_task(ensure_overlay(cfg, str(engines.python)))

    def installing() -> int:
        assert not task.done(), task
        return engines.calls("-m pip install")

    await eventually(installing, "the installer to start", timeout_s=60, interval_s=0.02)
    installer = [p for p in psutil.Process().children(recursive=True) if "pip" in p.cmdline()]
    assert installer, "the installer is running"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in installer)
    assert _overlays(cfg.work_dir) == []
