"""Starting an agent inside the link's namespace."""

from __future__ import annotations

from collections.abc import Mapping

from tests.partition.netns import NetnsLink
from tests.procs import ServiceProcess, agent_process
from tests.system.conftest import Stack


async def agent_in(
    stack: Stack, link: NetnsLink, node: str, env: Mapping[str, str]
) -> ServiceProcess:
    """An agent of `node` inside the namespace (its trainer too), on the stack's settings."""
    proc = agent_process(
        stack.settings, stack.tmp_path, node, {**env, "LORAFLEET_TEST_NETNS": link.ns}
    )
    proc.module = "tests.partition.in_netns"
    stack.agents[node] = proc
    stack.procs.append(proc)
    return await proc.start()
