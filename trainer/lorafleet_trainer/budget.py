"""The card's budget: torch's allocator capped so that the whole process
(the CUDA context included) stays within the job's gpu_memory_mib, and the
message of a job that ran out of it.
"""

from __future__ import annotations

import os
import re
from typing import Any

from lorafleet_trainer.jobfile import JobFile
from lorafleet_trainer.memory import CUDA_CONTEXT_MIB, MIB
from lorafleet_trainer.protocol import BadInputError


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


def cap_card_memory(device: Any, budget_mib: int) -> str:
    """Cap torch's allocator on `device` to the job's budget less the CUDA
    context; answers what was set, for the log. Exceeding it is then an
    out-of-memory of this process alone: a co-located engine keeps its memory."""
    import torch

    torch.zeros(1, device=device)  # the context exists from here on
    index = device.index or 0
    used = process_card_mib(index, os.getpid())
    reserved = int(torch.cuda.memory_reserved(device) // MIB)
    # At least CUDA_CONTEXT_MIB: measured right after start the context is
    # smaller, but kernels loaded lazily on first use grow it in the first steps.
    context = max(CUDA_CONTEXT_MIB, used - reserved if used is not None else 0)
    total = int(torch.cuda.get_device_properties(device).total_memory)
    fraction = memory_fraction(budget_mib, context, total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return (
        f"card budget {budget_mib} MiB: {context} MiB for the CUDA context, torch may "
        f"allocate {budget_mib - context} MiB ({fraction:.4f} of the card's {total // MIB} MiB)"
    )


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
    if type(e).__name__ == "OutOfMemoryError":  # torch's, for a card
        budget_mib, estimate_mib = (
            (None, None) if job is None else (job.gpu_memory_mib, job.estimate_mib)
        )
        return out_of_memory_message(str(e), budget_mib, estimate_mib)
    return f"{type(e).__name__}: {e}"
