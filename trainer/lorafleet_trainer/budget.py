"""The card's budget: torch's allocator capped so that the whole process
(the CUDA context included) stays within the job's gpu_memory_mib, and the
message of a job that ran out of it. On the CPU, the heap kept frugal
(`frugal_host_heap`) so that the process's memory is its tensors'. On
either, the process's peak read step by step (`PeakMeter`).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import re
import resource
import time
from pathlib import Path
from typing import Any

from lorafleet_trainer.jobfile import JobFile
from lorafleet_trainer.memory import CUDA_CONTEXT_MIB, MIB
from lorafleet_trainer.protocol import BadInputError, is_out_of_memory


def memory_fraction(budget_mib: int, context_mib: int, total_bytes: int) -> float:
    """The share of the card torch's allocator may take so that the whole
    process (the CUDA context NVML counts, and torch's tensors) stays within
    `budget_mib`. BadInputError when the context alone fills the budget."""
    allowed = (budget_mib - context_mib) * MIB
    if allowed <= 0:
        raise BadInputError(
            f"gpu_memory_mib {budget_mib} leaves nothing for the training: the CUDA context "
            f"alone takes {context_mib} MiB; give the job more gpu_memory_mib"
        )
    return min(1.0, allowed / total_bytes)


def process_card_mib(device_index: int, pid: int) -> int | None:
    """This process's card memory as NVML counts it, or None when NVML cannot
    tell (no nvidia-ml-py, or a container whose process ids NVML does not see)."""
    import torch

    try:
        text = torch.cuda.list_gpu_processes(device_index)
    except Exception:
        return None
    m = re.search(rf"process\s+{pid}\s+uses\s+([\d.]+)\s+MB", text)
    return round(float(m.group(1))) if m else None


def card_context_mib(device: Any) -> int | None:
    """What NVML counts for this process on `device` beyond torch's reserved
    memory (the CUDA context and the kernels loaded so far), or None when
    NVML cannot tell."""
    import torch

    used = process_card_mib(device.index or 0, os.getpid())
    return None if used is None else used - int(torch.cuda.memory_reserved(device) // MIB)


def set_card_cap(device: Any, budget_mib: int, context_mib: int) -> float:
    """Cap torch's allocator on `device` at the job's budget less
    `context_mib`; answers the share of the card set."""
    import torch

    total = int(torch.cuda.get_device_properties(device).total_memory)
    fraction = memory_fraction(budget_mib, context_mib, total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction


def cap_card_memory(device: Any, budget_mib: int) -> str:
    """Cap torch's allocator on `device` to the job's budget less the CUDA
    context; answers what was set, for the log. Exceeding it is then an
    out-of-memory of this process alone: a co-located engine keeps its memory.
    The context grows as kernels load; PeakMeter lowers the cap when it does."""
    import torch

    torch.zeros(1, device=device)  # the context exists from here on
    # At least CUDA_CONTEXT_MIB: measured right after start the context is
    # smaller, but kernels loaded lazily on first use grow it in the first steps.
    context = max(CUDA_CONTEXT_MIB, card_context_mib(device) or 0)
    fraction = set_card_cap(device, budget_mib, context)
    total = int(torch.cuda.get_device_properties(device).total_memory)
    return (
        f"card budget {budget_mib} MiB: {context} MiB for the CUDA context, torch may "
        f"allocate {budget_mib - context} MiB ({fraction:.4f} of the card's {total // MIB} MiB)"
    )


def release_card_cache(device: Any) -> None:
    """Give the card back what torch's allocator holds unused (after a step
    that ran out of memory: its blocks were sized for the plan it left)."""
    if device.type == "cuda":
        import torch

        torch.cuda.empty_cache()


def out_of_memory_message(error: str, budget_mib: int | None, estimate_mib: int | None) -> str:
    """The failure of a job that ran out of card memory: how much it asked for,
    its budget and estimate, and what to change."""
    first = error.split(".")[0]
    asked = re.search(r"Tried to allocate ([\d.]+ [KMG]iB)", error)
    what = f"asking for {asked.group(1)} more" if asked else first
    where = (
        f"the trainer ran out of its budget of {budget_mib} MiB (the job's gpu_memory_mib)"
        if budget_mib is not None
        else "the card ran out of memory"
    )
    known = f"; the memory estimate was {estimate_mib} MiB" if estimate_mib is not None else ""
    return (
        f"{where}, {what}{known}; lower batch_size or max_seq_len (raising "
        "gradient_accumulation keeps the batch), turn on gradient_checkpointing, or give "
        "the job more gpu_memory_mib"
    )


def failure_message(e: Exception, job: JobFile | None) -> str:
    """The "error" line of an unexpected exception: its type and text, or for
    torch's out-of-memory error the job's budget, its estimate and what to change."""
    if is_out_of_memory(e):
        budget_mib, estimate_mib = (
            (None, None) if job is None else (job.gpu_memory_mib, job.estimate_mib)
        )
        return out_of_memory_message(str(e), budget_mib, estimate_mib)
    return f"{type(e).__name__}: {e}"


#: glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: Blocks of at least this many bytes get their own mapping, returned to the
#: system when freed. glibc's default starts at 128 KiB but rises to 32 MiB
#: as big blocks are freed, after which a training step's transient tensors
#: come from the heap, whose freed holes between the kept activations the
#: process keeps (memory.HEAP_SLACK_FRACTION). Fixed at glibc's own start:
#: at 1 MiB a forward pass of a few narrow rows (the least plan's, 3 rows of
#: 143 tokens at hidden 512 in fp32: 0.86 MiB a tensor) still came from the
#: heap, and step 1 left 153 MiB of holes (1.35x its estimate); at 128 KiB,
#: 11 MiB. The price is a page fault per page of every mapped block
#: (memory.FRUGAL_HEAP_COST), which is why it is one of the plans a budget
#: may choose, not the default.
FRUGAL_MMAP_THRESHOLD_BYTES = 128 << 10


def frugal_host_heap() -> str | None:
    """Keep the heap from holding freed memory (FRUGAL_MMAP_THRESHOLD_BYTES),
    and give back what it holds now: for a CPU job whose memory plan has it
    (lorafleet_trainer.memory); answers what was set, for the log, or None
    where the C library is not glibc (or refuses)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        mallopt, trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    threshold = FRUGAL_MMAP_THRESHOLD_BYTES
    # A fixed threshold also ends glibc's raising of it.
    if not (mallopt(_M_MMAP_THRESHOLD, threshold) and mallopt(_M_TRIM_THRESHOLD, threshold)):
        return None
    trim(0)  # the free pages the heap holds already (a plan tightened mid-job)
    return (
        f"host heap: blocks of {threshold >> 10} KiB or more mapped and returned when freed "
        "(the process's memory stays its tensors', as the estimate counts them)"
    )


def trim_host_heap() -> None:
    """Give the system back the free pages glibc's heap holds (malloc_trim);
    nothing where the C library is not glibc."""
    with contextlib.suppress(OSError, AttributeError, TypeError):
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)


def _status_mib(field: str) -> int | None:
    """A "Vm..." field of /proc/self/status in MiB; None without /proc."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    m = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
    return int(m.group(1)) // 1024 if m else None


def process_rss_mib() -> int | None:
    """The process's resident memory now, MiB (None without /proc)."""
    return _status_mib("VmRSS")


#: A card's meter asks NVML for the process's memory at each of its first
#: readings (the context grows while a step's kernels load), then at most
#: once in NVML_READ_S: torch's own counters are read every step.
NVML_FIRST_READS, NVML_READ_S = 8, 1.0


class PeakMeter:
    """The process's peak memory, step by step. On the CPU its RSS's
    high-water mark (VmHWM), reset after each reading (/proc/self/clear_refs)
    so that the next reading is the next step's own; where the kernel does
    not allow the reset, the readings stay the process's peak so far. On a
    card torch's peak reserved bytes, reset the same way, plus the CUDA
    context (`context_mib`), as the estimate counts them: the context as
    NVML counts it where it can (it grows as kernels load: 610 MiB after
    the first tensor, 758 after a step on an H100), and with `budget_mib`
    the allocator's cap lowered as it grows, so that the process NVML
    counts stays within the budget. `process_peak_mib` is the highest of
    all readings: a reset also lowers getrusage's ru_maxrss, so that is no
    longer the process's."""

    def __init__(self, device: Any, context_mib: int = 0, budget_mib: int | None = None) -> None:
        self.device = device
        self.context_mib = context_mib
        self.budget_mib = budget_mib
        self.process_peak_mib = 0
        self._reads = 0
        self._nvml_at = 0.0

    def read(self) -> int:
        """The peak since the last reading (or since the process began)."""
        if self.device.type == "cuda":
            import torch

            self._recount_context()
            peak = int(torch.cuda.max_memory_reserved(self.device) // MIB) + self.context_mib
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            hwm = _status_mib("VmHWM")
            # Linux reports ru_maxrss in KiB.
            peak = (
                hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10
            )
            with contextlib.suppress(OSError):  # 5: the high-water mark only
                Path("/proc/self/clear_refs").write_text("5")
        self.process_peak_mib = max(self.process_peak_mib, peak)
        return peak

    def _recount_context(self) -> None:
        now = time.monotonic()
        self._reads += 1
        if self._reads > NVML_FIRST_READS and now - self._nvml_at < NVML_READ_S:
            return
        self._nvml_at = now
        context = card_context_mib(self.device)
        if context is None or context <= self.context_mib:
            return
        self.context_mib = context
        if self.budget_mib is not None:
            set_card_cap(self.device, self.budget_mib, context)
