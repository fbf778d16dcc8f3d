"""The memory a LoRA training job needs, from the model's shapes and the
trainer's parameters: the arithmetic of lorafleet.estimate (which words it
as lines for the control plane), here so that the trainer can choose how it
keeps to its budget before the weights load. Standard library only.

`estimate_lines(arch, params, ...)` answers (name, bytes, note) lines that add
up to the peak: weights, adapter, gradients, optimizer states, activations,
on a card the CUDA context and the allocator's slack, on the CPU the
process's own memory and what the C library's heap keeps (each line's rule:
libs/lorafleet/DESIGN.md). A `Plan` is one way to keep to a budget:
gradient checkpointing (`every` 0: none; k: every k-th decoder layer, 1:
every layer), on the CPU the frugal heap, and forward passes of fewer rows
than the micro-batch (lorafleet_trainer.plans chooses one).
`architecture_from_config` reads a config.json's sizes. `arch` is anything
with `Architecture`'s fields (the control plane's ModelArchitecture too),
`params` anything with `Params`'.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol, cast

MIB = 1 << 20

#: What NVML counts for a torch process on a card beyond torch's reserved
#: memory: the CUDA context, cuBLAS workspaces and the kernels loaded lazily on
#: first use. On an H100 (torch 2.11, CUDA 13, driver 580) 610 MiB after the
#: first tensor and 758 once a step's kernels had loaded, the same in all three
#: configurations of bench/trainer_estimate.py; 512 before, which left every
#: estimate there 246 MiB short. The trainer measures its own as it goes
#: (budget.PeakMeter); this is what an estimate made before it runs counts.
CUDA_CONTEXT_MIB = 768

#: The caching allocator's fragmentation on top of the tensors' bytes, as a
#: share of the activations (they are what is freed and re-made every step).
ALLOCATOR_SLACK_FRACTION = 0.10

#: The most fp32 logits one chunk of the loss holds (lorafleet_trainer.loss):
#: 64 MiB is 110 rows of a 152k vocabulary, enough rows that the projection's
#: matmul runs at full speed, and a small vocabulary's batch in one chunk.
LOSS_CHUNK_BYTES = 64 * MIB

#: The trainer process's RSS on the CPU before any tensor: the interpreter,
#: torch, transformers and peft, the tokenizer and the records (347 MiB in
#: bench/trainer_trl.py's small case). The trainer counts its own instead.
PROCESS_MIB = 400

#: What glibc's default heap keeps of freed blocks on the CPU, as a share of
#: a forward pass's activations (uncheckpointed): its mapping threshold rises
#: to 32 MiB as big blocks are freed, after which a step's transient tensors
#: come from the heap and the holes between the kept ones stay with the
#: process. Measured (less HEAP_SLACK_MIB) from 0.36 (152k vocabulary,
#: 8 x 512) to 0.6 (hidden 128 and 512, 2 and 8 x 512). HEAP_SLACK_MIB is
#: what either heap keeps between blocks under its mapping threshold (the
#: LoRA matrices' gradients and optimizer states, a pass's smallest
#: tensors): under the frugal heap (lorafleet_trainer.budget), step 1 of the
#: least plan left 11 MiB of holes and peaked 24 MiB over the rest.
HEAP_SLACK_FRACTION = 0.6
HEAP_SLACK_MIB = 40

#: How far over its estimate a step's peak may come before any step was
#: measured: the estimate's error, which bench/trainer_trl.py holds within
#: 10% of the measured peak in each of its cases. The guard reads a peak only
#: after a step, so step 1 has the estimate alone: a plan is chosen, and the
#: smallest budget named, as if the peak were this much over its estimate
#: (`budget_for`); from the first measured step on the guard goes by the
#: measured ratio instead. It costs only a budget within 10% of a plan's
#: estimate, which gets the next tighter plan (or, at the least, a refusal).
ESTIMATE_ERROR_FRACTION = 0.10

#: A step's time that a plan adds, relative to a step without any of it:
#: checkpointing every layer recomputes the decoder's forward pass (about a
#: third of a step; the loss's head is not recomputed); the frugal heap
#: faults in fresh pages for every big block (30 to 40% on the CPU); a
#: forward pass of half the rows, per halving: on a card the matmuls run
#: narrower, on the CPU the smaller working set stays in cache (measured
#: no slower: bench/trainer_trl.py).
RECOMPUTE_COST = 0.3
FRUGAL_HEAP_COST = 0.35
SPLIT_COST = {"cpu": 0.03, "cuda": 0.15}

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
_TORCH_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}

#: The Llama family's linear layers, as "all-linear" adapts them (lm_head excluded).
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class EstimateError(ValueError):
    """No estimate can be made: the message says what is missing."""


@dataclasses.dataclass(frozen=True)
class Architecture:
    """The sizes the estimate reads from a config.json."""

    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int | None = None
    weight_dtype: str = "bf16"
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    parameters: int | None = None


class Shapes(Protocol):
    """What the estimate reads of an architecture."""

    @property
    def num_hidden_layers(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def num_attention_heads(self) -> int: ...
    @property
    def num_key_value_heads(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def head_dim(self) -> int | None: ...
    @property
    def tie_word_embeddings(self) -> bool: ...
    @property
    def attention_bias(self) -> bool: ...
    @property
    def parameters(self) -> int | None: ...


class Knobs(Protocol):
    """What the estimate reads of the trainer's parameters."""

    @property
    def rank(self) -> int: ...
    @property
    def dropout(self) -> float: ...
    @property
    def target_modules(self) -> list[str] | str: ...
    @property
    def batch_size(self) -> int: ...
    @property
    def max_seq_len(self) -> int: ...
    @property
    def gradient_checkpointing(self) -> bool | str: ...
    @property
    def dtype(self) -> str: ...


def training_dtype(requested: str, device: str) -> str:
    """The dtype the trainer trains in: "auto" is bf16 on a card, fp32 on the CPU."""
    if requested == "auto":
        return "bf16" if device == "cuda" else "fp32"
    return requested


def chunk_rows(vocab_size: int) -> int:
    """The rows of one chunk of the loss: LOSS_CHUNK_BYTES of fp32 logits."""
    return max(1, LOSS_CHUNK_BYTES // (4 * vocab_size))


def _head_dim(arch: Shapes) -> int:
    return arch.head_dim or arch.hidden_size // arch.num_attention_heads


def linear_shapes(arch: Shapes) -> dict[str, tuple[int, int]]:
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


def parameter_count(arch: Shapes) -> int:
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


def adapter_matrices(arch: Shapes, target_modules: list[str] | str) -> list[int]:
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


def _layer_bytes(arch: Shapes, params: Knobs, a: int, device: str) -> int:
    """What one decoder layer keeps per token for the backward pass."""
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


def loss_chunk_bytes(arch: Shapes, tokens: int, dtype: str) -> int:
    """The loss's peak beyond what it keeps per token: one chunk's logits in
    fp32, their exponentials (logsumexp's, softmax's in the backward pass)
    and, under a 2-byte dtype, the gradient cast back to it."""
    a = DTYPE_BYTES[dtype]
    rows = min(chunk_rows(arch.vocab_size), tokens)
    return rows * arch.vocab_size * (4 + 4 + (a if a != 4 else 0))


def checkpointed_layers(layers: int, every: int) -> int:
    """The decoder layers checkpointed when every `every`-th is (0: none)."""
    return 0 if every == 0 else math.ceil(layers / every)


def activation_bytes(
    arch: Shapes,
    params: Knobs,
    seq_len: int,
    dtype: str,
    device: str,
    every: int,
    rows: int = 0,
) -> int:
    """The activations one forward pass of `rows` rows (0: batch_size) keeps
    for the backward pass, at its peak.

    Per token, a decoder layer keeps what `_layer_bytes` counts; a
    checkpointed one (every `every`-th from the first, 0: none) only its
    input (h). The head keeps the final norm's input, the answer rows'
    hidden states and their gradient (3h); the logits live one chunk at a
    time (`loss_chunk_bytes`): the peak at the loss is all of that. With
    checkpointing it may instead come when a checkpointed layer is rebuilt
    in the backward pass: what the layers below it keep, that layer, and the
    gradient flowing through it (2h).
    """
    a = DTYPE_BYTES[dtype]
    h = arch.hidden_size
    tokens = (rows or params.batch_size) * seq_len
    layer = _layer_bytes(arch, params, a, device)
    below, rebuilt = 0, 0
    for i in range(arch.num_hidden_layers):
        if every and i % every == 0:
            rebuilt = max(rebuilt, below + layer + 2 * h * a)
            below += h * a
        else:
            below += layer
    at_loss = tokens * (below + 3 * h * a) + loss_chunk_bytes(arch, tokens, dtype)
    return max(at_loss, tokens * rebuilt)


@dataclasses.dataclass(frozen=True)
class Plan:
    """How a step keeps to the memory: gradient checkpointing of every
    `every`-th decoder layer (0: none), on the CPU the frugal host heap
    (lorafleet_trainer.budget) or the C library's, and forward passes of
    `micro_rows` rows (0: the whole micro-batch; fewer split it, the
    gradients of its parts accumulated: the batch and its loss unchanged)."""

    every: int = 0
    frugal_heap: bool = False
    micro_rows: int = 0


def estimate_lines(
    arch: Shapes,
    params: Knobs,
    device: str,
    seq_len: int,
    every: int,
    *,
    frugal_heap: bool = False,
    micro_rows: int = 0,
    process_mib: int = PROCESS_MIB,
) -> list[tuple[str, int, str]]:
    """The estimate's (name, bytes, note) lines for rows of `seq_len` tokens,
    checkpointing every `every`-th layer (0: none), forward passes of
    `micro_rows` rows (0: batch_size) and on the CPU the heap the job runs
    with and the process's own `process_mib`."""
    params = pair_rows_of(params)
    dtype = training_dtype(params.dtype, device)
    matrices = adapter_matrices(arch, params.target_modules)
    adapter_params = params.rank * sum(matrices)
    steps = 4 * len(matrices) if device == "cpu" else 0
    weights = parameter_count(arch)
    rows = min(micro_rows or params.batch_size, params.batch_size)
    acts = activation_bytes(arch, params, seq_len, dtype, device, every, rows)
    split = f" a forward pass (of {params.batch_size})" if rows < params.batch_size else ""
    lines = [
        ("weights", weights * DTYPE_BYTES[dtype], f"{weights} parameters in {dtype}"),
        ("adapter", adapter_params * 4, f"{adapter_params} LoRA parameters in fp32"),
        ("gradients", adapter_params * 4, "one fp32 gradient per LoRA parameter"),
        (
            "optimizer states",
            adapter_params * 8 + steps,
            "AdamW's two fp32 moments per LoRA parameter"
            + (", its step counters" if steps else ""),
        ),
        (
            "activations",
            acts,
            f"{rows} rows{split} of {seq_len} tokens, "
            f"{checkpointing_words(every, arch.num_hidden_layers)}, "
            f"the loss over chunks of {chunk_rows(arch.vocab_size)} rows",
        ),
    ]
    overhead = (
        card_overhead_lines(acts)
        if device == "cuda"
        else host_overhead_lines(arch, params, seq_len, dtype, rows, frugal_heap, process_mib)
    )
    if isinstance(params, _PairRows):
        overhead.append(("reference pass", rows * 4, "DPO: log-probabilities, no gradients"))
    return lines + overhead


class _PairRows:
    """A DPO job's parameters as its passes see them: two rows a pair. Its
    reference pass (adapter disabled, no gradients) frees its activations
    before the policy's are made: a forward pass of time, not peak memory."""

    def __init__(self, params: Knobs) -> None:
        self._params, self.batch_size = params, 2 * params.batch_size

    def __getattr__(self, name: str) -> Any:
        return getattr(self._params, name)


def pair_rows_of(params: Knobs) -> Knobs:
    dpo = getattr(params, "method", "") == "dpo" and not isinstance(params, _PairRows)
    return cast(Knobs, _PairRows(params)) if dpo else params


def card_overhead_lines(acts: int) -> list[tuple[str, int, str]]:
    """What a card's process holds beyond its tensors."""
    return [
        ("CUDA context", CUDA_CONTEXT_MIB * MIB, "what NVML counts first"),
        (
            "allocator slack",
            int(acts * ALLOCATOR_SLACK_FRACTION),
            f"{ALLOCATOR_SLACK_FRACTION:.0%} of the activations",
        ),
    ]


def host_overhead_lines(
    arch: Shapes,
    params: Knobs,
    seq_len: int,
    dtype: str,
    rows: int,
    frugal_heap: bool,
    process_mib: int,
) -> list[tuple[str, int, str]]:
    """What a CPU job's process holds beyond its tensors: itself, and the
    heap's freed holes: those between blocks under either heap's mapping
    threshold (HEAP_SLACK_MIB), and with glibc's default heap those between
    a step's transient tensors too."""
    lines = [("process", process_mib * MIB, "the interpreter and libraries, before any tensor")]
    if frugal_heap:
        note = "the heap keeps freed holes between blocks under its mapping threshold"
        return [*lines, ("heap slack", HEAP_SLACK_MIB * MIB, note)]
    # Of a forward pass's activations as if none were checkpointed: a
    # rebuilt layer makes (and frees) them again all the same.
    whole = activation_bytes(arch, params, seq_len, dtype, "cpu", 0, rows)
    slack = int(whole * HEAP_SLACK_FRACTION) + HEAP_SLACK_MIB * MIB
    note = (
        f"the C library's heap keeps freed holes: {HEAP_SLACK_FRACTION:.0%} of the "
        f"forward pass's activations uncheckpointed, and {HEAP_SLACK_MIB} MiB"
    )
    return [*lines, ("heap slack", slack, note)]


def plan_lines(
    arch: Shapes,
    params: Knobs,
    device: str,
    seq_len: int,
    plan: Plan,
    process_mib: int = PROCESS_MIB,
) -> list[tuple[str, int, str]]:
    """`estimate_lines` of `plan`."""
    return estimate_lines(
        arch,
        params,
        device,
        seq_len,
        plan.every,
        frugal_heap=plan.frugal_heap,
        micro_rows=plan.micro_rows,
        process_mib=process_mib,
    )


def plan_mib(
    arch: Shapes,
    params: Knobs,
    device: str,
    seq_len: int,
    plan: Plan,
    process_mib: int = PROCESS_MIB,
) -> int:
    """The estimate of `plan` in MiB, rounded up."""
    lines = plan_lines(arch, params, device, seq_len, plan, process_mib)
    return math.ceil(sum(b for _, b, _ in lines) / MIB)


def budget_for(total_mib: int) -> int:
    """The least budget a plan of estimate `total_mib` MiB is chosen for before
    any step was measured (ESTIMATE_ERROR_FRACTION over it)."""
    return math.ceil(total_mib * (1 + ESTIMATE_ERROR_FRACTION))


def checkpointing_words(every: int, layers: int) -> str:
    """'no gradient checkpointing', 'gradient checkpointing every 3rd layer
    (4 of 10)', 'gradient checkpointing every layer'."""
    if every == 0:
        return "no gradient checkpointing"
    if every == 1:
        return "gradient checkpointing every layer"
    suffix = {2: "nd", 3: "rd"}.get(every % 10 if every % 100 not in (12, 13) else 0, "th")
    m = checkpointed_layers(layers, every)
    return f"gradient checkpointing every {every}{suffix} layer ({m} of {layers})"


def architecture_from_config(config: dict[str, Any]) -> Architecture:
    """The estimate's fields of a Hugging Face config.json (its text_config for a
    multimodal one). EstimateError naming what is missing."""
    if isinstance(config.get("text_config"), dict):
        config = {
            **config["text_config"],
            **{k: config[k] for k in ("torch_dtype", "dtype") if k in config},
        }
    required = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads")
    missing = [k for k in (*required, "vocab_size") if not isinstance(config.get(k), int)]
    if missing:
        raise EstimateError(
            f"config.json has no {', '.join(missing)}: not a decoder the estimate knows"
        )
    raw_dtype = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    return Architecture(
        num_hidden_layers=config["num_hidden_layers"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
        vocab_size=config["vocab_size"],
        head_dim=config.get("head_dim") if isinstance(config.get("head_dim"), int) else None,
        weight_dtype=_TORCH_DTYPES.get(str(raw_dtype), "bf16"),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=bool(config.get("attention_bias", config.get("model_type") == "qwen2")),
    )
