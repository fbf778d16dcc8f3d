"""Ctrl-C ends a command even when its first cancel is lost (cli/_app.py's
run_interruptibly): Python 3.11's asyncio.wait_for can drop a cancel that
meets its inner future's result, and a suite run's `lorafleet watch` went
on for 60 s after its SIGINT, twice. Here the command drops the first
cancel itself."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from lorafleet_services.cli._app import run_interruptibly


def test_a_lost_cancel_does_not_keep_a_command_running() -> None:
    lost: list[bool] = []

    async def command() -> None:
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, once
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            lost.append(True)  # the cancel dropped, as wait_for can
        await asyncio.sleep(30)

    with pytest.raises(KeyboardInterrupt):
        run_interruptibly(command)
    assert lost == [True]
