"""`python -m lorafleet_services.agent`: the node agent, configured from the environment
(LORAFLEET_* for the shared settings, LORAFLEET_AGENT_* for the agent's own)."""

from __future__ import annotations

import asyncio
import sys

from lorafleet import runtime
from lorafleet.settings import Settings, SettingsError
from lorafleet_services.agent.config import AgentConfig, AgentConfigError
from lorafleet_services.agent.service import run


def main(settings: Settings | None = None, cfg: AgentConfig | None = None) -> None:
    try:
        settings = settings or Settings.from_env()
        cfg = cfg or AgentConfig.from_env()
    except (SettingsError, AgentConfigError) as e:
        print(f"lorafleet agent: {e}", file=sys.stderr)
        sys.exit(2)
    agent_cfg = cfg

    async def run_agent(s: Settings, stop: asyncio.Event) -> None:
        await run(s, stop, agent_cfg)

    runtime.main("agent", run_agent, settings)


if __name__ == "__main__":
    main()
