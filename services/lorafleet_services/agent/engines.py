"""The engines installed on this node, as the heartbeat reports them.

vLLM: every `<engines_dir>/vllm/<version>/bin/python3` that exists, newest
last. llama.cpp: the newest `<engines_dir>/llamacpp/b<build>-...` release
tag (`b<build>`), or the configured tag. Reading them is a few directory
listings; the heartbeat still does it in a thread, away from the event loop.
"""

from __future__ import annotations

import re
from pathlib import Path

from lorafleet_schemas.messages import EnginesInstalled

_LLAMACPP_RE = re.compile(r"^b(\d+)(?:[-_.].*)?$")
_PART_RE = re.compile(r"(\d+)|([A-Za-z]+)")


def version_key(version: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key for version strings: numbers compare as numbers, so 0.10 > 0.9;
    a release sorts after its pre-releases ("0.10.0" > "0.10.0rc1")."""
    parts: list[tuple[int, int | str]] = []
    for num, word in _PART_RE.findall(version):
        parts.append((1, int(num)) if num else (0, word.lower()))
    # A trailing number-only version beats the same one with a suffix.
    parts.append((2, 0))
    return tuple(parts)


def vllm_versions(engines_dir: Path) -> list[str]:
    """Installed vLLM versions (those with a bin/python3), oldest first."""
    root = engines_dir / "vllm"
    try:
        found = [d.name for d in root.iterdir() if (d / "bin" / "python3").exists()]
    except OSError:
        return []
    return sorted(found, key=version_key)


def newest_vllm_python(engines_dir: Path) -> Path | None:
    """The newest installed vLLM's interpreter, or None."""
    versions = vllm_versions(engines_dir)
    return engines_dir / "vllm" / versions[-1] / "bin" / "python3" if versions else None


def llamacpp_tag(engines_dir: Path) -> str | None:
    """The newest llama.cpp release tag (`b<build>`) installed, or None."""
    root = engines_dir / "llamacpp"
    try:
        names = [d.name for d in root.iterdir() if d.is_dir()]
    except OSError:
        return None
    builds = [int(m.group(1)) for n in names if (m := _LLAMACPP_RE.match(n))]
    return f"b{max(builds)}" if builds else None


def find_engines(engines_dir: Path, llamacpp_override: str | None = None) -> EnginesInstalled:
    """What the heartbeat says is installed; a configured llama.cpp tag wins."""
    return EnginesInstalled(
        vllm=vllm_versions(engines_dir),
        llamacpp=llamacpp_override or llamacpp_tag(engines_dir),
    )
