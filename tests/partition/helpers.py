"""Starting an agent inside the link's namespace."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tests.partition.netns import NetnsLink
from tests.procs import ServiceProcess, agent_process
from tests.system.conftest import Stack


async def agent_in(
    stack: Stack,
    link: NetnsLink,
    node: str,
    env: Mapping[str, str],
    nats_url: str | None = None,
    **cfg: Any,
) -> ServiceProcess:
    """An agent of `node` inside the namespace (its trainer too), on the stack's
    settings (`nats_url`: another way to the server, such as a relay); `cfg`
    is its AgentConfig's (its engines)."""
    # `python -m tests.partition.in_netns` from any directory (the benches run it too).
    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    settings = stack.settings if nats_url is None else stack.settings.with_(nats_url=nats_url)
    proc = agent_process(
        settings,
        stack.tmp_path,
        node,
        {**env, "LORAFLEET_TEST_NETNS": link.ns, "PYTHONPATH": path},
        **cfg,
    )
    proc.module = "tests.partition.in_netns"
    stack.agents[node] = proc
    stack.procs.append(proc)
    return await proc.start()
