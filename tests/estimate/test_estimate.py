"""The memory estimate against the real tensors of a training step on the CPU,
and its reading of config.json."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import msgspec
import pytest

from lorafleet import estimate
from lorafleet.estimate import EstimateError, architecture_from_config, estimate_memory
from lorafleet_schemas.messages import ModelArchitecture, ModelSpec, TrainerParams
from lorafleet_services.local.tiny_model import build_tiny_model
from lorafleet_trainer import memory, plans
from tests.estimate.measure import measure_step
from tests.trainer.harness import fake_hf_cache

SMALL = {
    "vocab_size": 1000,
    "hidden_size": 128,
    "intermediate_size": 344,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}

#: (architecture, trainer parameters, within a budget): dropout or none,
#: checkpointing of every layer or (auto, within a budget that every 2nd
#: layer's estimate fits, with one row a batch: no forward passes of fewer
#: rows to choose instead) every 2nd, a few target modules, Qwen2's
#: attention biases.
CASES = [
    ("llama", {"batch_size": 4, "max_seq_len": 64, "rank": 8}, False),
    ("llama", {"batch_size": 2, "max_seq_len": 128, "rank": 4, "dropout": 0.0}, False),
    ("llama", {"batch_size": 2, "max_seq_len": 128, "gradient_checkpointing": True}, False),
    ("llama", {"batch_size": 1, "max_seq_len": 512, "rank": 8}, True),
    ("qwen2", {"batch_size": 2, "max_seq_len": 96, "target_modules": ["q_proj", "v_proj"]}, False),
    (
        "qwen2",
        {"batch_size": 3, "max_seq_len": 64, "gradient_checkpointing": True, "dropout": 0},
        False,
    ),
]


def _model(arch: str) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**SMALL))
    return Qwen2ForCausalLM(Qwen2Config(**SMALL))


@pytest.mark.parametrize(("arch", "params", "within"), CASES)
def test_the_lines_match_the_real_tensors_and_the_activations_are_close(
    arch: str, params: dict[str, Any], within: bool
) -> None:
    p = TrainerParams(dtype="fp32", **params)
    model = _model(arch)
    rng = random.Random(0)
    rows = [[rng.randrange(SMALL["vocab_size"]) for _ in range(p.max_seq_len)]] * p.batch_size
    shapes = architecture_from_config(model.config.to_dict())
    every_2nd = memory.plan_mib(shapes, p, "cpu", p.max_seq_len, memory.Plan(2))
    budget_mib = memory.budget_for(every_2nd) if within else None
    every = plans.choose_plan(shapes, p, "cpu", p.max_seq_len, budget_mib).every
    assert every == (2 if within else int(p.gradient_checkpointing is True))
    measured = measure_step(model, p, rows, every)
    lines = estimate_memory(shapes, p, device="cpu", budget_mib=budget_mib).lines
    est = {x.name: x.bytes for x in lines}
    for line in ("weights", "adapter", "gradients", "optimizer states"):
        assert est[line] == measured[line], line
    assert est["activations"] == pytest.approx(measured["activations"], rel=0.25)


def test_a_card_estimate_adds_the_context_and_slack_and_a_margin() -> None:
    arch = ModelArchitecture(**SMALL)
    p = TrainerParams(batch_size=4, max_seq_len=512)
    card = estimate_memory(arch, p)
    names = [x.name for x in card.lines]
    assert names == [
        "weights", "adapter", "gradients", "optimizer states", "activations",
        "CUDA context", "allocator slack",
    ]  # fmt: skip
    assert card.dtype == "bf16" and card.seq_len == 512
    assert card.total_bytes == sum(x.bytes for x in card.lines)
    assert card.total_mib == math.ceil(card.total_bytes / (1 << 20))
    assert card.recommended_mib == math.ceil(card.total_mib * 1.1)
    cpu = estimate_memory(arch, p, device="cpu")
    assert [x.name for x in cpu.lines] == [*names[:5], "process", "heap slack"]
    assert cpu.dtype == "fp32"
    # What the refusal tells the user to change does lower it.
    acts = {x.name: x.bytes for x in card.lines}["activations"]
    for change in ({"batch_size": 2}, {"max_seq_len": 256}, {"gradient_checkpointing": True}):
        lower = estimate_memory(arch, msgspec.structs.replace(p, **change))
        assert {x.name: x.bytes for x in lower.lines}["activations"] < acts, change
    # A known, shorter longest record lowers it too (rows are as wide as their longest).
    assert estimate_memory(arch, p, seq_len=100).seq_len == 100
    assert estimate_memory(arch, p, seq_len=5000).seq_len == 512


def test_target_modules_outside_the_llama_family_get_no_estimate() -> None:
    p = TrainerParams(target_modules=["q_proj", "c_attn"])
    with pytest.raises(EstimateError, match=r"\['c_attn'\].*give gpu_memory_mib yourself"):
        estimate_memory(ModelArchitecture(**SMALL), p)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_config_json_gives_the_real_parameter_count(arch: str, tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    base = build_tiny_model(arch, tmp_path)  # type: ignore[arg-type]
    got = estimate.read_architecture(local_dir=str(base))
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    assert memory.parameter_count(got) == sum(p.numel() for p in model.parameters())
    assert got.attention_bias is (arch == "qwen2")
    assert got.num_key_value_heads == 2 and got.weight_dtype == "fp32"


def test_the_architecture_is_read_from_the_hugging_face_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = build_tiny_model("llama", tmp_path / "tiny")
    fake_hf_cache(tmp_path / "hf", "org/tiny", base, revision="v1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    spec = ModelSpec(name="t", engine="vllm", hf_repo="org/tiny", hf_revision="v1")
    with_arch, note = estimate.with_architecture(spec)
    assert note == "" and with_arch.architecture == estimate.read_architecture(local_dir=str(base))
    missing, note = estimate.with_architecture(msgspec.structs.replace(spec, hf_revision="v2"))
    assert missing.architecture is None
    assert note.startswith("no architecture, so no memory estimates for its jobs")
    assert "no config.json in the Hugging Face cache for org/tiny@v2" in note


def test_a_config_without_the_sizes_is_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5", "d_model": 512}))
    with pytest.raises(EstimateError, match=r"config\.json has no num_hidden_layers, hidden_size"):
        estimate.read_architecture(local_dir=str(tmp_path))
    # A multimodal config's text part is what is read.
    nested = {"text_config": {**SMALL, "head_dim": 64}, "torch_dtype": "float16"}
    arch = architecture_from_config(nested)
    assert arch.head_dim == 64 and arch.weight_dtype == "fp16"
