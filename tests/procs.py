"""Running lorafleet services as real processes in tests (so they can be SIGKILLed).

The class lives in the package (the embedded default runs its children the
same way); tests import it from here.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lorafleet.settings import Settings
from lorafleet_services.agent.config import AgentConfig
from lorafleet_services.stack import START_TIMEOUT_S, ServiceProcess

__all__ = ["START_TIMEOUT_S", "ServiceProcess", "agent_process"]


def agent_process(
    settings: Settings,
    tmp_path: Path,
    node: str,
    env: Mapping[str, str] | None = None,
    **cfg: Any,
) -> ServiceProcess:
    """An agent process (not started) for tests: work and engines dirs under
    `tmp_path`, the stand-in trainer, CPU training allowed and a 1 s cancel
    grace unless `cfg` says otherwise; `env` adds variables (stand-in knobs)."""
    config = AgentConfig(
        node=node,
        work_dir=tmp_path / f"agent-{node}",
        engines_dir=tmp_path / "engines",
        trainer=cfg.pop("trainer", "standin"),
        allow_cpu=cfg.pop("allow_cpu", True),
        cancel_grace_s=cfg.pop("cancel_grace_s", 1.0),
        **cfg,
    )
    return ServiceProcess(
        "lorafleet_services.agent", settings, env={**config.to_env(), **(env or {})}
    )
