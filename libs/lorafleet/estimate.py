"""The peak card memory of a LoRA training job, estimated before it runs.

`estimate_memory(arch, params)` is a pure function of the model's shapes (a
`ModelArchitecture`, from its config.json) and the trainer's parameters. It
answers a `MemoryEstimate` whose lines add up to the total:

- weights: every base parameter in the training dtype (the trainer loads the
  weights in it: bf16 on a card by default, fp32 on the CPU);
- adapter: the LoRA A and B matrices of each targeted linear layer, in fp32
  (peft keeps them so under a bf16/fp16 base);
- gradients: one fp32 gradient per adapter parameter (the base is frozen);
- optimizer states: AdamW's two fp32 moments per adapter parameter, and on the
  CPU its step counter (a 4-byte tensor per adapter matrix; on a card it stays
  in host memory);
- activations: what one micro-batch of batch_size rows of seq_len tokens keeps
  for the backward pass at its peak (see `activation_bytes`);
- CUDA context and allocator slack (cards only): what NVML counts for the
  process beyond torch's tensors.

The model family is the Llama-shaped decoder (Llama, Mistral, Qwen2, ...:
q/k/v/o attention projections with grouped key/value heads, a gated MLP,
RMSNorm): target module names outside that family get no estimate
(`EstimateError`), as does a catalog model without its architecture.

`architecture_from_config(config)` turns a config.json's fields into a
`ModelArchitecture`; `read_architecture(...)` finds that file in a local
directory or the Hugging Face cache, without downloading anything.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import msgspec

from lorafleet_schemas.messages import (
    EstimateLine,
    MemoryEstimate,
    ModelArchitecture,
    ModelSpec,
    TrainerParams,
)

MIB = 1 << 20

#: The share a submit without gpu_memory_mib adds to the estimate.
MARGIN_FRACTION = 0.10

#: What NVML counts for a torch process on a card before any tensor: the CUDA
#: context, cuBLAS workspaces and the kernels loaded lazily on first use.
CUDA_CONTEXT_MIB = 512

#: The caching allocator's fragmentation on top of the tensors' bytes, as a
#: share of the activations (they are what is freed and re-made every step).
ALLOCATOR_SLACK_FRACTION = 0.10

_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
_TORCH_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}

#: The Llama family's linear layers, as "all-linear" adapts them (lm_head excluded).
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class EstimateError(ValueError):
    """No estimate can be made: the message says what is missing."""


def training_dtype(requested: str, device: str) -> str:
    """The dtype the trainer trains in: "auto" is bf16 on a card, fp32 on the CPU."""
    if requested == "auto":
        return "bf16" if device == "cuda" else "fp32"
    return requested


def _head_dim(arch: ModelArchitecture) -> int:
    return arch.head_dim or arch.hidden_size // arch.num_attention_heads


def linear_shapes(arch: ModelArchitecture) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each linear layer of one decoder layer."""
    h, i, hd = arch.hidden_size, arch.intermediate_size, _head_dim(arch)
    q, kv = arch.num_attention_heads * hd, arch.num_key_value_heads * hd
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def parameter_count(arch: ModelArchitecture) -> int:
    """The base's parameters: `arch.parameters` when given, else from the shapes."""
    if arch.parameters is not None:
        return arch.parameters
    shapes = linear_shapes(arch)
    per_layer = sum(a * b for a, b in shapes.values()) + 2 * arch.hidden_size  # two RMSNorms
    if arch.attention_bias:
        per_layer += sum(shapes[m][1] for m in ("q_proj", "k_proj", "v_proj"))
    embed = arch.vocab_size * arch.hidden_size
    head = 0 if arch.tie_word_embeddings else embed
    return arch.num_hidden_layers * per_layer + embed + head + arch.hidden_size


def adapter_matrices(arch: ModelArchitecture, target_modules: list[str] | str) -> list[int]:
    """The parameter count of each LoRA matrix (A and B of every targeted layer), per
    unit of rank: a matrix of in x r has `in` here."""
    names = list(ALL_LINEAR) if target_modules == "all-linear" else list(target_modules)
    shapes = linear_shapes(arch)
    unknown = [n for n in names if n not in shapes]
    if unknown:
        raise EstimateError(
            f"no memory estimate for target modules {unknown}: the estimate knows the "
            f"Llama family's {list(ALL_LINEAR)}; give gpu_memory_mib yourself"
        )
    per_layer = [x for n in names for x in shapes[n]]
    return per_layer * arch.num_hidden_layers


def _layer_bytes(arch: ModelArchitecture, params: TrainerParams, a: int, device: str) -> int:
    """What one decoder layer keeps per token for the backward pass (see
    `activation_bytes`)."""
    h, i, hd = arch.hidden_size, arch.intermediate_size, _head_dim(arch)
    q = arch.num_attention_heads * hd
    shapes = linear_shapes(arch)
    names = set(ALL_LINEAR if params.target_modules == "all-linear" else params.target_modules)
    # Always: each RMSNorm's input, the attention kernel's query, key, value
    # (repeated to the query heads' width) and output, and the MLP's gate, its
    # SiLU and up (a frozen linear layer keeps nothing: its input is needed only
    # for its own weights' gradient).
    kept = 2 * h + 4 * q + 3 * i
    # Each adapted layer keeps its LoRA A output; its input too (with dropout,
    # each its own dropped copy and the dropout mask: a byte an element on a
    # card's fused kernel, the dtype's bytes on the CPU's).
    kept_bytes = len(names) * params.rank * a
    if params.dropout > 0:
        mask = 1 if device == "cuda" else a
        kept_bytes += sum(shapes[n][0] * (a + mask) for n in names)
    else:
        inputs = {
            "q_proj": "n1",
            "k_proj": "n1",
            "v_proj": "n1",
            "gate_proj": "n2",
            "up_proj": "n2",
        }
        shared = {inputs[n] for n in names if n in inputs}
        kept += len(shared) * h + ("o_proj" in names) * q + ("down_proj" in names) * i
    return kept * a + kept_bytes


def activation_bytes(
    arch: ModelArchitecture, params: TrainerParams, seq_len: int, dtype: str, device: str
) -> int:
    """The activations one micro-batch keeps for the backward pass, at its peak.

    Per token, a decoder layer keeps what `_layer_bytes` counts. The head keeps
    the final norm's input and the logits: in the dtype (the model's output
    holds them all through the backward pass), again in fp32 for the loss (not
    in an fp32 run), log-softmax's fp32 output, and the fp32 gradient the
    backward pass starts with; the peak is there. With gradient checkpointing a
    layer keeps only its input (h), and the peak may instead come when one
    layer is rebuilt in the backward pass: the layers' inputs, the logits, that
    layer and the gradient flowing through it (2h).
    """
    a = _DTYPE_BYTES[dtype]
    h = arch.hidden_size
    layer = _layer_bytes(arch, params, a, device)
    head = h * a + arch.vocab_size * (a + (4 if a != 4 else 0) + 4 + 4)
    if params.gradient_checkpointing:
        inputs = arch.num_hidden_layers * h * a
        rebuilt = arch.vocab_size * a + layer + 2 * h * a
        per_token = inputs + max(head, rebuilt)
    else:
        per_token = arch.num_hidden_layers * layer + head
    return params.batch_size * seq_len * per_token


def _line(name: str, n: int, note: str) -> EstimateLine:
    return EstimateLine(name=name, bytes=n, mib=round(n / MIB, 1), note=note)


def estimate_memory(
    arch: ModelArchitecture,
    params: TrainerParams,
    *,
    device: str = "cuda",
    seq_len: int | None = None,
) -> MemoryEstimate:
    """The peak memory of training `arch` with `params` on `device` ("cuda" or
    "cpu"), line by line. `seq_len`: the longest row a micro-batch holds (the
    data's longest record, when known); default max_seq_len."""
    dtype = training_dtype(params.dtype, device)
    rows = min(seq_len or params.max_seq_len, params.max_seq_len)
    matrices = adapter_matrices(arch, params.target_modules)
    adapter_params = params.rank * sum(matrices)
    steps = 4 * len(matrices) if device == "cpu" else 0
    lines = [
        _line(
            "weights",
            parameter_count(arch) * _DTYPE_BYTES[dtype],
            f"{parameter_count(arch)} parameters in {dtype}",
        ),
        _line("adapter", adapter_params * 4, f"{adapter_params} LoRA parameters in fp32"),
        _line("gradients", adapter_params * 4, "one fp32 gradient per LoRA parameter"),
        _line(
            "optimizer states",
            adapter_params * 8 + steps,
            "AdamW's two fp32 moments per LoRA parameter"
            + (", its step counters" if steps else ""),
        ),
        _line(
            "activations",
            activation_bytes(arch, params, rows, dtype, device),
            f"{params.batch_size} rows of {rows} tokens"
            + (", gradient checkpointing" if params.gradient_checkpointing else ""),
        ),
    ]
    if device == "cuda":
        slack = int(lines[-1].bytes * ALLOCATOR_SLACK_FRACTION)
        lines.append(_line("CUDA context", CUDA_CONTEXT_MIB * MIB, "what NVML counts first"))
        lines.append(
            _line("allocator slack", slack, f"{ALLOCATOR_SLACK_FRACTION:.0%} of the activations")
        )
    total = sum(x.bytes for x in lines)
    total_mib = math.ceil(total / MIB)
    return MemoryEstimate(
        lines=lines,
        total_bytes=total,
        total_mib=total_mib,
        recommended_mib=math.ceil(total_mib * (1 + MARGIN_FRACTION)),
        margin_fraction=MARGIN_FRACTION,
        seq_len=rows,
        dtype=dtype,
    )


def shortfall_message(estimate: MemoryEstimate, gpu_memory_mib: int) -> str:
    """Why `gpu_memory_mib` is refused, with both numbers and what to change."""
    return (
        f"gpu_memory_mib {gpu_memory_mib} is below the memory estimate of "
        f"{estimate.total_mib} MiB ({estimate.recommended_mib} MiB with the "
        f"{estimate.margin_fraction:.0%} margin); give at least {estimate.total_mib}, "
        "or lower params.batch_size or params.max_seq_len (raising "
        "gradient_accumulation keeps the batch), or turn on "
        "params.gradient_checkpointing; or submit anyway with ignore_estimate"
    )


# --- config.json -------------------------------------------------------------

_REQUIRED = (
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "vocab_size",
)


def architecture_from_config(config: dict[str, Any]) -> ModelArchitecture:
    """The estimate's fields of a Hugging Face config.json (its text_config for a
    multimodal one). EstimateError naming what is missing."""
    if isinstance(config.get("text_config"), dict):
        config = {
            **config["text_config"],
            **{k: config[k] for k in ("torch_dtype", "dtype") if k in config},
        }
    missing = [k for k in _REQUIRED if not isinstance(config.get(k), int)]
    if missing:
        raise EstimateError(
            f"config.json has no {', '.join(missing)}: not a decoder the estimate knows"
        )
    raw_dtype = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    return ModelArchitecture(
        num_hidden_layers=config["num_hidden_layers"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
        vocab_size=config["vocab_size"],
        head_dim=config.get("head_dim") if isinstance(config.get("head_dim"), int) else None,
        weight_dtype=_TORCH_DTYPES.get(str(raw_dtype), "bf16"),  # type: ignore[arg-type]
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=bool(config.get("attention_bias", config.get("model_type") == "qwen2")),
    )


def _hf_cache_config(hf_repo: str, revision: str) -> Path | None:
    """config.json of `hf_repo` at `revision` in the Hugging Face cache, if there."""
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    hub = Path(os.environ.get("HF_HUB_CACHE", home / "hub"))
    repo_dir = hub / ("models--" + hf_repo.replace("/", "--"))
    ref = repo_dir / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    path = repo_dir / "snapshots" / commit / "config.json"
    return path if path.is_file() else None


def read_architecture(
    *, local_dir: str | None = None, hf_repo: str | None = None, hf_revision: str = "main"
) -> ModelArchitecture:
    """The architecture from config.json in `local_dir`, or in the Hugging Face
    cache for `hf_repo` (HF_HOME / HF_HUB_CACHE; nothing is downloaded).
    EstimateError when the file is not there or lacks a field."""
    if local_dir is not None:
        path: Path | None = Path(local_dir) / "config.json"
        where = f"{local_dir}"
    elif hf_repo is not None:
        path = _hf_cache_config(hf_repo, hf_revision)
        where = f"the Hugging Face cache for {hf_repo}@{hf_revision}"
    else:
        raise EstimateError("give local_dir or hf_repo")
    if path is None or not path.is_file():
        raise EstimateError(f"no config.json in {where}")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise EstimateError(f"{path} cannot be read as JSON: {e}") from None
    if not isinstance(config, dict):
        raise EstimateError(f"{path} does not hold a JSON object")
    return architecture_from_config(config)


def with_architecture(spec: ModelSpec) -> tuple[ModelSpec, str]:
    """`spec` with its architecture read from config.json (local_dir, else the
    Hugging Face cache), and "" ; or `spec` as it is and why none was read."""
    if spec.architecture is not None:
        return spec, ""
    try:
        arch = read_architecture(
            local_dir=spec.local_dir, hf_repo=spec.hf_repo, hf_revision=spec.hf_revision
        )
    except EstimateError as e:
        return spec, f"no architecture, so no memory estimates for its jobs: {e}"
    return msgspec.structs.replace(spec, architecture=arch), ""
