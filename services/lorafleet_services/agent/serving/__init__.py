"""Serving adapters on the node's engines.

- agent: `ServingAgent`, what the node serves and its reports;
- orders: an adapter version to serve, from a job or a request;
- plan: the desired set, eviction and reload back-off;
- reports: serving reports, published in order;
- vllm_adapters: an adapter loaded into a running vLLM and checked;
- llamacpp: a GGUF adapter for the node's llama.cpp server;
- running_engines: the vLLM and llama.cpp servers running on the node;
- engine_watch: the running engines and their adapters, re-read periodically;
- vllm_client: vLLM's HTTP API.
"""

from lorafleet_services.agent.serving.agent import ServingAgent
from lorafleet_services.agent.serving.engine_watch import EngineWatch
from lorafleet_services.agent.serving.orders import ServeOrder
from lorafleet_services.agent.serving.plan import DesiredAdapter, DesiredSet
from lorafleet_services.agent.serving.reports import ServingReporter
from lorafleet_services.agent.serving.running_engines import VllmServer, running_vllm_servers
from lorafleet_services.agent.serving.vllm_adapters import serve_adapter, unserve_adapter
from lorafleet_services.agent.serving.vllm_client import VllmClient, VllmError

__all__ = [
    "DesiredAdapter",
    "DesiredSet",
    "EngineWatch",
    "ServeOrder",
    "ServingAgent",
    "ServingReporter",
    "VllmClient",
    "VllmError",
    "VllmServer",
    "running_vllm_servers",
    "serve_adapter",
    "unserve_adapter",
]
