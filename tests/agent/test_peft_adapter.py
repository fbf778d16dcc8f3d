"""The one parse of adapter_config.json (agent/peft_adapter.py), and the two
readers that use it agreeing on what an adapter is."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lorafleet_services.agent.environment.gguf_conversion import ConversionError, check_adapter
from lorafleet_services.agent.peft_adapter import AdapterConfigError, PeftAdapterConfig
from lorafleet_services.agent.serving.vllm_adapters import AdapterToServe

LORA: dict[str, Any] = {
    "peft_type": "LORA",
    "r": 8,
    "lora_alpha": 16,
    "target_modules": ["model.layers.0.mlp.down_proj", "q_proj"],
    "modules_to_save": None,
    "use_rslora": False,
    "task_type": "CAUSAL_LM",  # a field lorafleet does not read: ignored
}


def write(tmp_path: Path, config: object) -> Path:
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    return tmp_path


def test_a_lora_config_reads_as_both_readers_see_it(tmp_path: Path) -> None:
    config = PeftAdapterConfig.read(write(tmp_path, LORA))
    assert config == PeftAdapterConfig(rank=8, target_modules=frozenset({"down_proj", "q_proj"}))
    assert config.llamacpp_refusals() == []
    assert check_adapter(tmp_path) == config
    served = AdapterToServe.read("j1", "a" * 64, tmp_path, "/m", "llama")
    assert (served.rank, served.target_modules) == (config.rank, config.target_modules)


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"peft_type": "IA3"}, "is IA3, not LoRA"),
        ({"r": None}, "r \\(the rank\\) is None"),
        ({"r": 0}, "r \\(the rank\\) is 0"),
        ({"r": "8"}, "r \\(the rank\\) is '8'"),
        ({"r": True}, "r \\(the rank\\) is True"),
    ],
)
def test_what_is_no_lora_adapter_is_refused_by_both_readers(
    tmp_path: Path, change: dict[str, object], says: str
) -> None:
    write(tmp_path, {**LORA, **change})
    with pytest.raises(AdapterConfigError, match=says):
        PeftAdapterConfig.read(tmp_path)
    with pytest.raises(ConversionError, match=says):
        check_adapter(tmp_path)
    with pytest.raises(AdapterConfigError, match=says):
        AdapterToServe.read("j1", "a" * 64, tmp_path, "/m", "llama")


def test_a_missing_or_malformed_file_says_so(tmp_path: Path) -> None:
    with pytest.raises(AdapterConfigError, match="not a PEFT adapter"):
        PeftAdapterConfig.read(tmp_path)
    (tmp_path / "adapter_config.json").write_text("{")
    with pytest.raises(AdapterConfigError, match="not a PEFT adapter"):
        PeftAdapterConfig.read(tmp_path)
    write(tmp_path, [LORA])
    with pytest.raises(AdapterConfigError, match="is not a JSON object"):
        PeftAdapterConfig.read(tmp_path)


def test_one_target_module_and_saved_modules_read_as_lists(tmp_path: Path) -> None:
    config = PeftAdapterConfig.read(
        write(tmp_path, {**LORA, "target_modules": "q_proj", "modules_to_save": ["lm_head"]})
    )
    assert config.target_modules == {"q_proj"} and config.modules_to_save == ("lm_head",)


def test_what_llamacpp_cannot_express_is_named(tmp_path: Path) -> None:
    config = PeftAdapterConfig.read(
        write(tmp_path, {**LORA, "use_dora": True, "rank_pattern": {"q_proj": 4}})
    )
    assert config.llamacpp_refusals() == ["DoRA", "per-module ranks"]
