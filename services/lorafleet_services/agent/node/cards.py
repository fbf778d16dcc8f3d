"""The node's cards, read from NVML, and the choice of the card a job trains on.

nvidia-ml-py is the binding; where there is no NVIDIA driver, `read_cards`
returns no cards and `nvml_available()` says why once.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from lorafleet_schemas.messages import Card

_lock = threading.Lock()
_nvml_state: tuple[bool, str] | None = None


class NoCardError(RuntimeError):
    """No card on this node can hold the job (and the CPU is not allowed)."""


def nvml_available() -> tuple[bool, str]:
    """(True, "") once NVML initialises; (False, why) where there is no driver."""
    global _nvml_state
    with _lock:
        if _nvml_state is None:
            try:
                import pynvml

                pynvml.nvmlInit()
                _nvml_state = (True, "")
            except Exception as e:
                _nvml_state = (False, f"no NVIDIA driver to read cards from ({e})")
        return _nvml_state


def read_cards() -> list[Card]:
    """Every card with its total and free MiB; [] without NVML. Blocking (~1 ms/card)."""
    ok, _ = nvml_available()
    if not ok:
        return []
    import pynvml

    cards: list[Card] = []
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        name = pynvml.nvmlDeviceGetName(h)
        if isinstance(name, bytes):
            name = name.decode()
        cards.append(
            Card(
                index=i,
                name=str(name),
                total_mib=int(mem.total) // (1 << 20),
                free_mib=int(mem.free) // (1 << 20),
            )
        )
    return cards


def process_memory_mib(pids: set[int]) -> int:
    """Card memory (MiB) used by these processes on all cards, from NVML; 0 without it."""
    ok, _ = nvml_available()
    if not ok or not pids:
        return 0
    import pynvml

    total = 0
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        try:
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
        except pynvml.NVMLError:
            continue
        for p in procs:
            if p.pid in pids and p.usedGpuMemory:
                total += int(p.usedGpuMemory) // (1 << 20)
    return total


@dataclass(frozen=True, slots=True)
class CardChoice:
    """Where a job trains: a card index, or None for the CPU."""

    index: int | None
    name: str
    free_mib: int

    @property
    def device(self) -> str:
        return "cpu" if self.index is None else "cuda"


def choose_card(cards: list[Card], need_mib: int, allow_cpu: bool, node: str) -> CardChoice:
    """The card with the most free memory, if that is at least `need_mib` —
    even beside a running engine; the CPU when there are no cards and it is
    allowed. Otherwise NoCardError saying what the best card has."""
    if not cards:
        if allow_cpu:
            return CardChoice(index=None, name="cpu", free_mib=0)
        raise NoCardError(
            f"{node} has no GPU to train on (NVML sees none) and CPU training is off; "
            "train on a node with a card, or start its agent with --allow-cpu"
        )
    best = max(cards, key=lambda c: (c.free_mib, -c.index))
    if best.free_mib < need_mib:
        raise NoCardError(
            f"no card on {node} has {need_mib} MiB free: the most free is GPU {best.index} "
            f"({best.name}) with {best.free_mib} MiB; ask for less, or free a card"
        )
    return CardChoice(index=best.index, name=best.name, free_mib=best.free_mib)
