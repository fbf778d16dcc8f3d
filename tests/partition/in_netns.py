"""`python -m tests.partition.in_netns`: become the agent inside the test's
namespace (`LORAFLEET_TEST_NETNS`). An exec, so the pid, the session and the
output pipe stay the ones the test's ServiceProcess started and watches."""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    ns = os.environ["LORAFLEET_TEST_NETNS"]
    os.execvp("ip", ["ip", "netns", "exec", ns, sys.executable, "-m", "lorafleet_services.agent"])
