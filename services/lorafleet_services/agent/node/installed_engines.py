"""The engines installed on this node: what the heartbeat reports, and the
one vLLM discovery the trainer's Python is chosen from.

vLLM: every `<engines_dir>/vllm/<version>/` with an executable
`bin/python3`, ordered by `version_order` (PEP 440, `packaging.version`):
0.10.2 < 0.11.0rc1 < 0.11.0 < 0.11.0+cu128 (a local build sorts after its
release); a name that is no version sorts before every version. The
heartbeat lists them oldest first and the trainer takes the last, so both
name the same vLLM. llama.cpp: the configured tag, else the newest installed
`<engines_dir>/llamacpp/b<build>[-_.]...` as `b<build>` (`llamacpp_tag`: the
GGUF converter asks it too, so both name the same release). Reading them is a few
directory listings; the heartbeat still does it in a thread, away from the
event loop.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from packaging.version import InvalidVersion, Version

from lorafleet_schemas.messages import EnginesInstalled

#: An installed llama.cpp release: a directory `b<build>`, alone or followed
#: by `-`, `_` or `.` and anything (`b5000`, `b5000-cuda12`, `b5000_cuda`).
_LLAMACPP_INSTALL_RE = re.compile(r"^b(\d+)(?:[-_.].*)?$")


def version_order(name: str) -> tuple[int, Version | str]:
    """Sort key for a directory named for a version: PEP 440 order
    (0.10 > 0.9, a release after its pre-releases and before its local
    builds); names that are no version first, by name."""
    try:
        return (1, Version(name))
    except InvalidVersion:
        return (0, name)


def vllm_versions(engines_dir: Path) -> list[str]:
    """Installed vLLM versions (those with an executable bin/python3), oldest first."""
    root = engines_dir / "vllm"
    try:
        found = [d.name for d in root.iterdir() if _runnable(d / "bin" / "python3")]
    except OSError:
        return []
    return sorted(found, key=version_order)


def newest_vllm_python(engines_dir: Path) -> Path | None:
    """The newest installed vLLM's interpreter, or None."""
    versions = vllm_versions(engines_dir)
    return engines_dir / "vllm" / versions[-1] / "bin" / "python3" if versions else None


def _runnable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def llamacpp_tag(engines_dir: Path, configured: str | None = None) -> str | None:
    """The llama.cpp release this node serves and converts with: `configured`
    when set (AgentConfig checked it), else the newest installed
    `<engines_dir>/llamacpp/b<build>[-_.]...` directory (build numbers
    compared as numbers) as `b<build>`; None when there is none. The
    heartbeat reports it and the GGUF converter fetches its scripts."""
    if configured:
        return configured
    root = engines_dir / "llamacpp"
    try:
        names = [d.name for d in root.iterdir() if d.is_dir()]
    except OSError:
        return None
    builds = [int(m.group(1)) for n in names if (m := _LLAMACPP_INSTALL_RE.match(n))]
    return f"b{max(builds)}" if builds else None


def find_engines(engines_dir: Path, llamacpp_configured: str | None = None) -> EnginesInstalled:
    """What the heartbeat says is installed; a configured llama.cpp tag wins."""
    return EnginesInstalled(
        vllm=vllm_versions(engines_dir),
        llamacpp=llamacpp_tag(engines_dir, llamacpp_configured),
    )
