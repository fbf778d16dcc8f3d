"""The vLLM command lines and the serving preflight, as plain functions (no
processes): flags read as vLLM reads them, each refusal naming its lift."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from lorafleet.fleet_serving import served_adapter_name
from lorafleet_services.agent.config import AgentConfig, AgentConfigError
from lorafleet_services.agent.serving.running_engines import (
    VllmServer,
    is_vllm_server,
    parse_configured,
    parse_server_argv,
    runtime_updating,
)
from lorafleet_services.agent.serving.vllm_adapters import (
    AdapterToServe,
    ServeRefused,
    preflight,
)

PY = "/opt/engines/vllm/0.32.0/bin/python3"


def test_module_form_with_every_flag_style() -> None:
    argv = [
        PY, "-m", "vllm.entrypoints.openai.api_server", "--model=/models/tiny",
        "--served-model-name", "tiny", "tiny-alias", "--enable-lora", "--max_lora_rank", "32",
        "--max-loras=3", "--max-cpu-loras", "5", "--host", "0.0.0.0", "--port=8123",
        "--api-key", "s3cret", "--dtype", "float32",
    ]  # fmt: skip
    server = parse_server_argv(argv, {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    assert server == VllmServer(
        url="http://127.0.0.1:8123",
        api_key="s3cret",
        model="/models/tiny",
        served_names=("tiny", "tiny-alias"),
        enable_lora=True,
        max_lora_rank=32,
        max_loras=3,
        max_cpu_loras=5,
        runtime_updating=True,
    )
    assert server.base_name == "tiny"


def test_vllm_serve_form_takes_vllm_defaults() -> None:
    server = parse_server_argv(["/usr/bin/vllm", "serve", "Qwen/Qwen2.5-0.5B"], env={})
    assert server.url == "http://127.0.0.1:8000"
    assert server.model == "Qwen/Qwen2.5-0.5B"
    assert server.served_names == ("Qwen/Qwen2.5-0.5B",)
    assert (server.enable_lora, server.max_lora_rank, server.max_loras) == (False, 16, 1)
    assert server.max_cpu_loras == 1  # vLLM: max_cpu_loras defaults to max_loras
    assert server.runtime_updating is False


def test_boolean_off_and_key_from_the_environment() -> None:
    argv = ["vllm", "serve", "m", "--enable-lora", "--no-enable-lora", "--host", "::1"]
    server = parse_server_argv(argv, {"VLLM_API_KEY": "k"})
    assert server.enable_lora is False
    assert server.api_key == "k"
    assert server.url == "http://[::1]:8000"


def test_unreadable_environment_is_unknown() -> None:
    argv = [PY, "-m", "vllm.entrypoints.openai.api_server", "--model", "m"]
    assert parse_server_argv(argv, None).runtime_updating is None


@pytest.mark.parametrize(
    ("value", "on"), [("1", True), ("true", True), (" TRUE ", True), ("0", False), ("yes", False)]
)
def test_runtime_updating_as_vllm_reads_it(value: str, on: bool) -> None:
    assert runtime_updating({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": value}) is on


def test_other_processes_are_not_servers() -> None:
    assert not is_vllm_server([PY, "-m", "vllm.entrypoints.cli.main", "bench"])
    assert not is_vllm_server(["python", "-c", "from multiprocessing.spawn import spawn_main"])
    assert not is_vllm_server(["vllm", "chat"])
    with pytest.raises(ValueError, match="not a vLLM server"):
        parse_server_argv(["python", "train.py"])


@pytest.mark.parametrize("host", [None, "0.0.0.0", "::", "[::]", ""])
def test_an_engine_on_every_address_is_reported_at_the_advertised_host(host: str | None) -> None:
    argv = ["vllm", "serve", "m", "--port", "8123"] + (["--host", host] if host is not None else [])
    assert parse_server_argv(argv, {}, "gpu-3.example").url == "http://gpu-3.example:8123"
    assert parse_server_argv(argv, {}, "10.0.0.7").url == "http://10.0.0.7:8123"
    assert parse_server_argv(argv, {}, "fd00::7").url == "http://[fd00::7]:8123"
    # Nothing advertised: the only address that is surely this node's.
    assert parse_server_argv(argv, {}).url == "http://127.0.0.1:8123"


@pytest.mark.parametrize("host", ["127.0.0.1", "10.0.0.9", "::1"])
def test_an_engine_on_one_address_is_reported_there_whatever_is_advertised(host: str) -> None:
    argv = ["vllm", "serve", "m", "--host", host]
    url = parse_server_argv(argv, {}, "gpu-3.example").url
    assert url == f"http://{f'[{host}]' if ':' in host else host}:8000"


def test_the_advertised_host_is_an_agent_setting_and_no_wildcard() -> None:
    env = {"LORAFLEET_AGENT_NODE": "n1", "LORAFLEET_AGENT_ADVERTISE_HOST": "gpu-3.example"}
    assert AgentConfig.from_env(env).advertise_host == "gpu-3.example"
    assert AgentConfig.from_env({"LORAFLEET_AGENT_NODE": "n1"}).advertise_host is None
    for wildcard in ("0.0.0.0", "::", ""):
        with pytest.raises(AgentConfigError, match="LORAFLEET_AGENT_ADVERTISE_HOST"):
            AgentConfig(node="n1", advertise_host=wildcard)


def test_configured_servers() -> None:
    assert parse_configured(["http://gpu:8000/", "http://127.0.0.1:9000|key"]) == [
        VllmServer(url="http://gpu:8000"),
        VllmServer(url="http://127.0.0.1:9000", api_key="key"),
    ]


ENGINE = VllmServer(
    url="http://127.0.0.1:8000",
    model="/models/tiny",
    served_names=("/models/tiny",),
    enable_lora=True,
    max_lora_rank=16,
    max_loras=2,
    max_cpu_loras=2,
    runtime_updating=True,
)
ADAPTER = AdapterToServe(
    job_id="j1",
    sha256="ab" * 32,
    directory=Path("/srv/adapters/a1"),
    base_model="/models/tiny",
    model_type="llama",
    rank=8,
    target_modules=frozenset({"q_proj", "v_proj"}),
)


def test_a_fitting_adapter_passes() -> None:
    assert preflight(ENGINE, ADAPTER, loaded=["other"]) is None
    # Limits the agent does not know are the engine's to check.
    unknown = VllmServer(url="http://gpu:8000", model="/models/tiny")
    assert preflight(unknown, replace(ADAPTER, rank=512), loaded=["a", "b", "c"]) is None


@pytest.mark.parametrize(
    ("engine", "adapter", "loaded", "limit", "lift"),
    [
        (ENGINE, replace(ADAPTER, rank=24), [], "max_lora_rank", "--max-lora-rank 32"),
        (replace(ENGINE, runtime_updating=False), ADAPTER, [], "runtime updating",
         "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True in the engine's environment"),
        (replace(ENGINE, enable_lora=False), ADAPTER, [], "enable_lora", "--enable-lora"),
        (ENGINE, replace(ADAPTER, base_model="/models/other"), [], "base model",
         "an engine started with --model /models/other"),
        (ENGINE, ADAPTER, ["a", "b"], "max_cpu_loras", "--max-cpu-loras 3, or unserve one"),
        (ENGINE, replace(ADAPTER, target_modules=frozenset({"q_proj", "lm_head"})), [],
         "target modules", "train with target modules among down_proj, gate_proj, k_proj, "
         "o_proj, q_proj, up_proj, v_proj"),
        (ENGINE, replace(ADAPTER, modules_to_save=("score",)), [], "modules_to_save",
         "train without modules_to_save"),
    ],
)  # fmt: skip
def test_each_refusal_names_its_lift(
    engine: VllmServer, adapter: AdapterToServe, loaded: list[str], limit: str, lift: str
) -> None:
    refused = preflight(engine, adapter, loaded)
    assert isinstance(refused, ServeRefused)
    assert (refused.limit, refused.lift) == (limit, lift)


def test_the_same_version_reloading_takes_no_new_slot() -> None:
    full = [served_adapter_name("j1", "ab" * 32), "other"]
    assert preflight(ENGINE, ADAPTER, loaded=full) is None


def test_names_are_per_adapter_version() -> None:
    assert served_adapter_name("j1", "0123456789abcdef" * 4) == "j1-0123456789ab"
    assert served_adapter_name("j1", "f" * 64) != served_adapter_name("j1", "e" * 64)
