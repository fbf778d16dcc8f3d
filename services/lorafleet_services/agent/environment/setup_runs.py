"""The short helper processes the trainer's set-up runs (interpreter
probes, installers, import checks, the user's start check): run to their
end or killed at a timeout, their last lines kept for the error message,
in a plain environment built from nothing."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path

from lorafleet_services.agent.config import EngineUser
from lorafleet_services.agent.node.process import run_process

#: Seconds the interpreter probe and the user's start check may take.
PROBE_TIMEOUT_S = 60.0
#: Seconds a helper stopped at its timeout gets between SIGTERM and SIGKILL.
HELPER_STOP_GRACE_S = 2.0
#: The PATH of the helpers, and of the trainer after its interpreter's own bin directory.
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def plain_env(home: str) -> dict[str, str]:
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


async def run_helper(
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
            run_process(
                argv, env=env, cwd=cwd, user=user, on_line=keep, grace_s=HELPER_STOP_GRACE_S
            ),
            timeout_s,
        )
    except TimeoutError:
        return -1, list(lines), f"killed after {timeout_s:.0f} s"
    tail = [ln for ln in list(lines)[-3:] if ln.strip()]
    if res.stderr_tail:
        tail.append(res.stderr_tail)
    return res.returncode, list(lines), " | ".join(tail)
