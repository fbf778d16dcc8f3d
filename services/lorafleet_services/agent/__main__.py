"""`python -m lorafleet_services.agent`: the node agent, configured from the environment
(LORAFLEET_* for the shared settings, LORAFLEET_AGENT_* for the agent's own)."""

from __future__ import annotations

from lorafleet import _runtime as runtime
from lorafleet_services.agent.config import AgentConfig
from lorafleet_services.agent.service import program


def main() -> None:
    runtime.main(program(runtime.read_or_exit("agent", AgentConfig.from_env)))


if __name__ == "__main__":
    main()
