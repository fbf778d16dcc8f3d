"""The trainer's card memory, from NVML: `MemorySampler` samples, in a
thread of its own every NVML_SAMPLE_S, what the processes of the trainer's
session (`session_pids`: the trainer and whatever it started) hold, and
keeps the peak. Without NVML it samples nothing (peak 0)."""

from __future__ import annotations

import contextlib
import os
import threading

import psutil

import lorafleet_services.agent.node.cards as cards_mod

#: Seconds between NVML samples of the trainer's card memory.
NVML_SAMPLE_S = 1.0


def session_pids(sid: int) -> set[int]:
    """Every process in session `sid` (the trainer and whatever it started)."""
    pids: set[int] = set()
    for pid in psutil.pids():
        with contextlib.suppress(OSError):  # gone since the listing
            if os.getsid(pid) == sid:
                pids.add(pid)
    return pids


class MemorySampler:
    """The trainer's card memory from NVML, sampled in a thread; keeps the peak."""

    def __init__(self, sid: int, interval_s: float = NVML_SAMPLE_S) -> None:
        self.sid = sid
        self.interval_s = interval_s
        self.peak_mib = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if not cards_mod.nvml_available()[0]:
            return
        self._thread = threading.Thread(target=self._run, name="nvml-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):
                used = cards_mod.process_memory_mib(session_pids(self.sid))
                self.peak_mib = max(self.peak_mib, used)
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        self._stop.set()
