"""The tests' real vLLM server: lorafleet_services.local.vllm_launch (the CPU build
from the engines cache, serving a tiny Llama built on the spot). The session
fixture `vllm_server` (tests/conftest.py) starts one per test session;
tests share it and leave it as they found it."""

from lorafleet_services.local.vllm_launch import (
    MAX_LORA_RANK,
    MAX_LORAS,
    RunningVllm,
    free_port,
    running_vllm,
    server_argv,
)

__all__ = ["MAX_LORAS", "MAX_LORA_RANK", "RunningVllm", "free_port", "running_vllm", "server_argv"]
