"""The trainer's card budget, on the CPU: the allocator's share of the card, the
process's NVML reading, the job file's fields, and the out-of-memory report.
(Setting the cap itself needs a card; bench/trainer_gpu.py checks it on one.)
And the frugal host heap of a CPU job that checkpoints."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lorafleet_trainer.budget import failure_message, memory_fraction, process_card_mib
from lorafleet_trainer.jobfile import JobFile
from lorafleet_trainer.protocol import BadInputError
from tests.trainer.harness import write_job

MIB = 1 << 20
TORCH_OOM = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB "
    "of which 1.50 GiB is free. Of the allocated memory 5.10 GiB is allocated by PyTorch"
)


def test_the_allocator_gets_the_budget_less_the_context() -> None:
    fraction = memory_fraction
    card = 80 * 1024 * MIB
    assert fraction(8000, 512, card) == pytest.approx((8000 - 512) / (80 * 1024))
    assert fraction(10**7, 512, card) == 1.0  # never above the whole card
    with pytest.raises(BadInputError) as e:
        fraction(500, 512, card)
    assert str(e.value) == (
        "gpu_memory_mib 500 leaves nothing for the training: the CUDA context alone takes "
        "512 MiB; give the job more gpu_memory_mib"
    )


def test_the_process_card_memory_is_read_from_nvml_for_this_pid(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    listing = (
        "GPU:0\nprocess       4242 uses      612.500 MB GPU memory\n"
        "process         77 uses    30000.000 MB GPU memory"
    )
    monkeypatch.setattr(torch.cuda, "list_gpu_processes", lambda device=None: listing)
    assert process_card_mib(0, 4242) == 612
    assert process_card_mib(0, 42) is None  # not this process's line

    def no_nvml(device: Any = None) -> str:
        raise RuntimeError("no NVML")

    monkeypatch.setattr(torch.cuda, "list_gpu_processes", no_nvml)
    assert process_card_mib(0, 4242) is None


def test_running_out_of_the_budget_says_what_it_asked_for_and_what_to_change(
    tmp_path: Path,
) -> None:
    import torch

    capped = write_job(tmp_path, tmp_path, data="", gpu_memory_mib=8000, estimate_mib=7100)
    message = failure_message(torch.OutOfMemoryError(TORCH_OOM), JobFile.read(capped))
    assert message == (
        "the trainer ran out of its budget of 8000 MiB (the job's gpu_memory_mib), asking for "
        "2.00 GiB more; the memory estimate was 7100 MiB; lower batch_size or max_seq_len "
        "(raising gradient_accumulation keeps the batch), turn on gradient_checkpointing, or "
        "give the job more gpu_memory_mib"
    )
    uncapped = failure_message(
        torch.OutOfMemoryError(TORCH_OOM), JobFile.read(write_job(tmp_path, tmp_path, data=""))
    )
    assert uncapped.startswith("the card ran out of memory, asking for 2.00 GiB more; lower")
    assert failure_message(ValueError("x"), None) == "ValueError: x"


@pytest.mark.parametrize("bad", [0, -5, "8000", True, 1.5])
def test_the_job_files_memory_fields_are_checked(tmp_path: Path, bad: Any) -> None:
    import json

    path = write_job(tmp_path, tmp_path, data="", gpu_memory_mib=bad)
    with pytest.raises(BadInputError, match="the job's gpu_memory_mib is"):
        JobFile.parse(json.loads(path.read_text()))
    good = write_job(tmp_path, tmp_path, data="", gpu_memory_mib=8000, estimate_mib=7100)
    job = JobFile.parse(json.loads(good.read_text()))
    assert (job.gpu_memory_mib, job.estimate_mib) == (8000, 7100)


#: Where a 2 MiB block comes from after an 8 MiB one was freed: glibc's
#: default raises its mapping threshold to 8 MiB on that free, so the 2 MiB
#: comes from the heap (whose freed holes the process keeps); the frugal
#: heap maps it (returned to the system when freed). Prints "heap" or "mapped".
_HEAP_PROBE = """
import ctypes, sys
from lorafleet_trainer.budget import frugal_host_heap
if sys.argv[1] == "frugal":
    assert frugal_host_heap() is not None
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.free(libc.malloc(8 << 20))
block = libc.malloc(2 << 20)
(heap,) = [line.split()[0] for line in open("/proc/self/maps") if line.rstrip().endswith("[heap]")]
start, end = (int(x, 16) for x in heap.split("-"))
print("heap" if start <= block < end else "mapped")
"""


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc")
def test_a_frugal_heap_maps_big_blocks() -> None:
    def source(mode: str) -> str:
        argv = [sys.executable, "-c", _HEAP_PROBE, mode]
        return subprocess.run(argv, capture_output=True, text=True, check=True).stdout.strip()

    assert (source("default"), source("frugal")) == ("heap", "mapped")
