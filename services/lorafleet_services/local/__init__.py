"""Tools for this machine: the CPU vLLM, tiny models, a local vLLM server."""
