"""A real terminal for the CLI's tests: a tmux session of a fixed size.

Type with `type()` (tmux send-keys), read what a person sees with
`screen()` (capture-pane) — `history()` adds what scrolled off the top, so
a test can tell a display redrawn in place from one that scrolls.
Each terminal has a tmux server of its own (`-L`): one shared by the test
workers exits when its last session closes, under another worker's
`new-session`.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import uuid
from collections.abc import Mapping

import pytest

from tests.eventually import eventually

#: The terminal's size: wide enough for the tables, short enough to scroll.
COLUMNS, ROWS = 120, 40


class Terminal:
    def __init__(self, env: Mapping[str, str], cwd: str) -> None:
        if shutil.which("tmux") is None:  # ./dev installs it (SYSTEM_TOOLS)
            pytest.fail("tmux is not installed: run ./dev test, or apt-get install tmux")
        self.session = f"lf-test-{uuid.uuid4().hex[:8]}"
        self.windows = 0
        env_args = [arg for k, v in env.items() for arg in ("-e", f"{k}={v}")]
        self._tmux(
            "new-session", "-d", "-s", self.session, "-x", str(COLUMNS), "-y", str(ROWS),
            "-c", cwd, *env_args,
        )  # fmt: skip
        self._tmux("set-option", "-t", self.session, "history-limit", "20000")

    def _tmux(self, *args: str) -> str:
        return subprocess.run(
            ["tmux", "-L", self.session, *args],
            check=True,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout

    def new_window(self) -> str:
        """A new window of the same size; its target."""
        self.windows += 1
        self._tmux("new-window", "-t", f"{self.session}:{self.windows}")
        return f"{self.session}:{self.windows}"

    def type(self, window: str, *argv: str, then: str = "") -> None:
        """Type the command `argv` (quoted) and Enter; `then` is shell appended as is."""
        self._tmux("send-keys", "-t", window, shlex.join(argv) + then, "Enter")

    def keys(self, window: str, *keys: str) -> None:
        self._tmux("send-keys", "-t", window, *keys)

    def screen(self, window: str) -> str:
        return self._tmux("capture-pane", "-p", "-t", window)

    def history(self, window: str, joined: bool = False) -> str:
        """Everything the window shows and everything that scrolled off it
        (`joined`: a line the window wrapped as one)."""
        return self._tmux(
            "capture-pane", "-p", *(["-J"] if joined else []), "-S", "-", "-t", window
        )

    async def wait_for(self, window: str, text: str, timeout_s: float = 60.0) -> str:
        """The window's screen once it shows `text`."""
        return await eventually(
            lambda: self.screen(window),
            f"{text!r} on the screen of {window}",
            until=lambda s: text in s,
            timeout_s=timeout_s,
            interval_s=0.2,
        )

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.session, "kill-server"], check=False, timeout=10)
