"""Running lorafleet services as real processes in tests (so they can be SIGKILLed).

The process class lives in the package (the embedded default runs its
children the same way); tests import it from here, where it gains the
waits only tests need (`wait_for_event`, on `eventually()`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lorafleet.settings import Settings
from lorafleet_services import stack
from lorafleet_services.agent.config import AgentConfig
from lorafleet_services.stack import SERVICE_START_TIMEOUT_S
from tests.eventually import NeverHappenedError, eventually

__all__ = ["EVENT_TIMEOUT_S", "SERVICE_START_TIMEOUT_S", "ServiceProcess", "agent_process"]

#: Seconds `wait_for_event` waits unless told otherwise.
EVENT_TIMEOUT_S = 30.0


class ServiceProcess(stack.ServiceProcess):
    """The package's child process, with the waits of the tests."""

    async def wait_for_event(self, name: str, timeout_s: float = EVENT_TIMEOUT_S) -> dict[str, Any]:
        """The latest log line with event `name`, once the child has logged one."""
        try:
            found = await eventually(
                lambda: self.events(name), f"{self.module} to log {name}", timeout_s=timeout_s
            )
        except NeverHappenedError as e:
            # What the child said last is what explains a missing event.
            raise NeverHappenedError(f"{e}; its last lines:\n{self.tail()}") from None
        return found[-1]


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
        engines_dir=cfg.pop("engines_dir", tmp_path / "engines"),
        trainer=cfg.pop("trainer", "standin"),
        allow_cpu=cfg.pop("allow_cpu", True),
        cancel_grace_s=cfg.pop("cancel_grace_s", 1.0),
        **cfg,
    )
    return ServiceProcess(
        "lorafleet_services.agent", settings, env={**config.to_env(), **(env or {})}
    )
