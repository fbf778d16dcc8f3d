"""The engines' user: the unprivileged user the trainer (and the GGUF
converter) runs as, with a home of its own under work_dir; the agent runs
the trainer as itself, and says why with how to fix it, when it cannot
(not root, no such user, a work directory it cannot reach, an interpreter
it cannot start). See docs/deploy.md (nodes)."""

from __future__ import annotations

import asyncio
import grp
import os
import pwd
import stat
from collections.abc import Sequence
from pathlib import Path

from lorafleet_services.agent.config import AgentConfig, EngineUser
from lorafleet_services.agent.environment.setup_runs import PROBE_TIMEOUT_S, plain_env, run_helper

#: The groups the engines' user needs for the GPU device nodes.
DEVICE_GROUPS = ("video", "render")


def _fix_user(name: str) -> str:
    return f"useradd --system --shell /usr/sbin/nologin {name} && usermod -aG video,render {name}"


def chown_tree(path: Path, uid: int, gid: int) -> None:
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


def self_user(home: Path) -> EngineUser:
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
    me = self_user(home).name
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
            chown_tree(home, pw.pw_uid, pw.pw_gid)
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
    env = {**plain_env(str(user.home)), **user.env()}
    try:
        rc, _out, tail = await run_helper(
            [python, "-c", "import site"],
            env=env,
            cwd=user.home,
            user=user,
            timeout_s=PROBE_TIMEOUT_S,
        )
    except OSError as e:
        return str(e)
    return "" if rc == 0 else (tail or f"exit {rc}")


async def settle_user(cfg: AgentConfig, python: str) -> tuple[EngineUser | None, list[str]]:
    """The user the trainer runs as (None: the agent's own) and the notes the
    job's log and message should say about it (each says how to fix it)."""
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
    return user, notes
