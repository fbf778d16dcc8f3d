"""The PEFT reference each load is confirmed against, kept per adapter version.

An adapter's stored `probe.json` answers at once; without one the probe
program runs in the trainer's Python and environment, on the CPU, from a
copy of the trainer package made once per agent (seconds per version), so
a version is asked once however often it is loaded again.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import lorafleet_services.agent.environment.environments as environment
from lorafleet_services.agent.config import AgentConfig
from lorafleet_services.agent.node.cards import CardChoice
from lorafleet_services.agent.serving.vllm_adapters import (
    AdapterToServe,
    ProbeReference,
    adapter_reference,
)


class ProbeReferences:
    """served name -> its reference, filled on first use."""

    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        self.known: dict[str, ProbeReference] = {}
        self._probe: tuple[str, dict[str, str], Path] | None = None

    async def of(self, adapter: AdapterToServe, probe_base: str) -> ProbeReference:
        cached = self.known.get(adapter.served_name)
        if cached is None:
            python, env, root = await self._probe_env()
            cached = await adapter_reference(python, probe_base, adapter.directory, env, root)
            self.known[adapter.served_name] = cached
        return cached

    async def _probe_env(self) -> tuple[str, dict[str, str], Path]:
        """The trainer's Python and environment, on the CPU, and the directory
        holding the trainer package: the probe program's."""
        if self._probe is None:
            env = await environment.trainer_environment(self.cfg)
            root = self.cfg.work_dir / "probe"
            root.mkdir(parents=True, exist_ok=True)
            await asyncio.to_thread(environment.copy_trainer_package, root)
            env.give(root)
            self._probe = (env.python, env.process_env(CardChoice(None, "cpu", 0)), root)
        return self._probe
