"""Converting a real PEFT adapter with llama.cpp b11312's own converter (fetched
through the agent's path) and reading the GGUF back."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGUFReader
from safetensors.numpy import load_file

from lorafleet_services.agent.config import AgentConfig
from lorafleet_services.agent.environment.gguf_conversion import (
    ConversionCancelledError,
    ConversionError,
    check_adapter,
    convert_to_gguf,
)
from lorafleet_services.local.tiny_model import TINY_SIZES
from tests.conversion.adapters import ALPHA, RANK, TARGETS
from tests.conversion.conftest import (
    ARCHES,
    Converted,
    Tiny,
    environment,
    processes_mentioning,
    recording_python,
)
from tests.eventually import eventually


def _field(reader: GGUFReader, key: str) -> Any:
    return reader.fields[key].contents()


@pytest.mark.parametrize("arch", ARCHES)
def test_the_gguf_reads_back_as_this_lora(
    arch: str, converted: dict[str, Converted], tiny: dict[str, Tiny]
) -> None:
    reader = GGUFReader(converted[arch].gguf)
    assert _field(reader, "general.architecture") == arch
    assert _field(reader, "general.type") == "adapter"
    assert _field(reader, "adapter.type") == "lora"
    assert _field(reader, "adapter.lora.alpha") == pytest.approx(ALPHA)

    tensors = {t.name: t for t in reader.tensors}
    peft = load_file(tiny[arch].adapter / "adapter_model.safetensors")
    expected = set()
    for layer in range(TINY_SIZES["num_hidden_layers"]):
        for module, gguf_name in TARGETS.items():
            group = (
                "self_attn" if module.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            )
            prefix = f"base_model.model.model.layers.{layer}.{group}.{module}"
            lora_a, lora_b = peft[f"{prefix}.lora_A.weight"], peft[f"{prefix}.lora_B.weight"]
            name = f"blk.{layer}.{gguf_name}.weight"
            expected |= {f"{name}.lora_a", f"{name}.lora_b"}
            a, b = tensors[f"{name}.lora_a"], tensors[f"{name}.lora_b"]
            assert a.data.shape == lora_a.shape and lora_a.shape[0] == RANK
            assert b.data.shape == lora_b.shape and lora_b.shape[1] == RANK
            assert a.data.dtype == np.float16 and b.data.dtype == np.float16
            np.testing.assert_allclose(a.data, lora_a, rtol=1e-3, atol=1e-4)
            if not (arch == "llama" and module in ("q_proj", "k_proj")):
                # (llama.cpp permutes Llama's q/k rows for its RoPE layout;
                # the parity test covers those.)
                np.testing.assert_allclose(b.data, lora_b, rtol=1e-3, atol=1e-4)
    assert set(tensors) == expected


def test_it_runs_the_release_converter_with_its_own_gguf_py_first(
    converted: dict[str, Converted], fetched: AgentConfig, tiny: dict[str, Tiny]
) -> None:
    record = converted["qwen2"].record
    code = fetched.work_dir / "llama.cpp-b11312"
    assert record[0] == f"PYTHONPATH={code / 'gguf-py'}:{code}:{converted['qwen2'].overlay}"
    assert record[1] == "HF_HUB_OFFLINE=1"
    out_dir = converted["qwen2"].gguf.parent
    assert record[2].startswith(f"CWD={out_dir}/.gguf-")
    argv = record[3:]
    assert argv[0] == str(code / "convert_lora_to_gguf.py")
    assert argv[argv.index("--base") + 1] == str(tiny["qwen2"].base)
    assert argv[argv.index("--outtype") + 1] == "f16"
    assert argv[-1] == str(tiny["qwen2"].adapter)
    # Whole or nothing: only the GGUF is left beside it.
    assert [p.name for p in out_dir.iterdir()] == ["adapter.gguf"]


async def test_a_converter_failure_fails_with_its_last_lines(
    fetched: AgentConfig, tiny: dict[str, Tiny], tmp_path: Path
) -> None:
    base = tmp_path / "base"
    shutil.copytree(tiny["llama"].base, base)
    config = json.loads((base / "config.json").read_text())
    config["architectures"] = ["NoSuchModelForCausalLM"]
    (base / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out" / "adapter.gguf"
    # No tag configured: the installed release's (b11312 beside an older one) is used.
    engines = tmp_path / "engines"
    for name in ("b11312-0c1e57098", "b9999"):
        (engines / "llamacpp" / name).mkdir(parents=True)
    cfg = fetched.with_(llamacpp_tag=None, engines_dir=engines)
    with pytest.raises(ConversionError) as e:
        await convert_to_gguf(cfg, environment(tmp_path), tiny["llama"].adapter, base, out)
    message = str(e.value)
    assert message.startswith("llama.cpp b11312's convert_lora_to_gguf.py failed (exit 1): ")
    assert "NoSuchModelForCausalLM is not supported" in message
    assert list(out.parent.iterdir()) == []


async def test_a_cancelled_conversion_stops_and_leaves_nothing(
    fetched: AgentConfig, tiny: dict[str, Tiny], tmp_path: Path
) -> None:
    record = tmp_path / "record.txt"
    env = environment(tmp_path, recording_python(tmp_path / "python", record))
    out = tmp_path / "out" / "adapter.gguf"
    cancel = asyncio.Event()
    task = asyncio.create_task(
        convert_to_gguf(fetched, env, tiny["llama"].adapter, tiny["llama"].base, out, cancel)
    )
    # Cancel once the converter is running (it takes seconds to import torch).
    await eventually(record.exists, "the converter to start", timeout_s=10, interval_s=0.05)
    await asyncio.sleep(1.0)  # inside Python now, importing torch
    cancel.set()
    with pytest.raises(ConversionCancelledError):
        await asyncio.wait_for(task, 30)
    assert list(out.parent.iterdir()) == []
    assert processes_mentioning(str(tmp_path)) == []


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"use_rslora": True}, "rank-stabilised"),
        ({"use_dora": True}, "DoRA"),
        ({"alpha_pattern": {"q_proj": 32}}, "per-module alphas"),
        ({"peft_type": "IA3"}, "only LoRA"),
    ],
)
def test_what_llamacpp_cannot_express_is_refused_before_converting(
    tmp_path: Path, change: dict[str, object], says: str
) -> None:
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "use_rslora": False, **change}
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match=says):
        check_adapter(tmp_path)


def test_a_missing_adapter_config_says_so(tmp_path: Path) -> None:
    with pytest.raises(ConversionError, match="not a PEFT adapter"):
        check_adapter(tmp_path)


async def test_a_conversion_cancelled_before_it_starts_runs_nothing(
    fetched: AgentConfig, tiny: dict[str, Tiny], tmp_path: Path
) -> None:
    record = tmp_path / "record.txt"
    env = environment(tmp_path, recording_python(tmp_path / "python", record))
    cancel = asyncio.Event()
    cancel.set()
    out = tmp_path / "out" / "adapter.gguf"
    with pytest.raises(ConversionCancelledError):
        await convert_to_gguf(fetched, env, tiny["qwen2"].adapter, tiny["qwen2"].base, out, cancel)
    assert not record.exists() and not out.exists()
