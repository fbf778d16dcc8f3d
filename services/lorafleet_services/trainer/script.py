"""lorafleet's LoRA trainer: one self-contained script, run in a node's engine Python.

    python script.py job.json

It imports only the standard library, torch, transformers (and its
huggingface_hub), peft, accelerate and safetensors: never lorafleet's own
packages or msgspec, which the engine's Python does not have. The agent
writes it into the job directory and runs it as the engines' user.

The job file (JSON object; every key required unless a default is given)
-----------------------------------------------------------------------
    job_id       str
    base         {"hf_repo": str | null, "hf_revision": str (default "main"),
                  "local_dir": str | null}; exactly one of hf_repo and local_dir.
                 hf_repo is read from the Hugging Face cache (HF_HOME, set by the
                 agent) with huggingface_hub.snapshot_download; local_dir is a
                 directory holding config.json, tokenizer files and *.safetensors.
    data_path    str: NDJSON, one record a line: {"q": str, "a": str} or
                 {"messages": [{"role": "system"|"user"|"assistant",
                 "content": str}, ...]} (at least one assistant message; every
                 assistant message is trained on, turns after the last one are
                 context only). Blank lines are skipped.
    data_sha256  str: lowercase hex sha256 of the data file; a mismatch is refused.
    out_dir      str: the adapter goes to <out_dir>/adapter.
    params       object: the TrainerParams fields (lorafleet_schemas.messages),
                 each optional with the same defaults and bounds (`Params` and
                 `PARAM_RULES` below are generated from it). max_steps 0 means as
                 many as epochs take, > 0 wins over epochs; dtype "auto" is bf16
                 on cards with bf16, fp16 on other cards, fp32 on the CPU.
                 Unknown keys are refused.
    device       "cuda" | "cpu" (default "cuda"); with cuda the first visible card.
    gpu_memory_mib  int | null (default null): on a card, what the whole process
                 may use, CUDA context included: torch's allocator is capped at
                 it less the context (`cap_card_memory`), so going over is an
                 out-of-memory of this process alone, reported with the budget.
    estimate_mib int | null (default null): the job's memory estimate, named in
                 that report.
    hf_offline   bool (default true): read the Hugging Face cache only.
    checkpoint_dir  str | null (default null): where checkpoints go (created if
                 missing; .tmp-* leftovers of crashed writes are cleared); null:
                 none, whatever params.checkpoint_every_* say.
    resume       {"dir": str, "mode": "continue" | "weights"} | null (default
                 null). dir: a checkpoint directory (holding checkpoint.json), or
                 a directory of them (its newest complete step-*), or for
                 "weights" also a peft adapter directory (adapter_model.safetensors).
                 "continue": this job's own checkpoint; checkpoint.json and its
                 fingerprint are checked (bad input naming what differs), the
                 adapter, optimizer, LR scheduler, GradScaler and RNG states and
                 the data-plan position restored, and training goes on with the
                 step after the checkpoint's: the same losses and, on the CPU,
                 the same adapter as a run never interrupted. "weights": only the
                 adapter weights are loaded (same rank and target modules, else
                 bad input) and the job trains from step 1, on its own schedule.

The protocol: stdout, one JSON object per line, the field "event" naming it
--------------------------------------------------------------------------
    {"event": "log", "message", "level": "info"|"warning"}  (first: uid=...)
    {"event": "state", "state": "preparing"|"running"|"saving", "message"}
                 preparing repeats while the records are tokenized ("tokenizing:
                 N of M records").
    {"event": "step", "step", "steps", "loss", "learning_rate", "tokens_per_s",
     "eta_s", "peak_mib", "epoch"}   one per optimizer step; loss is the mean
                 over the step's micro-batches; tokens_per_s counts real tokens,
                 not padding; peak_mib is torch's peak reserved
                 MiB on a card, the peak RSS MiB on the CPU; epoch counts from 1.
    {"event": "lengths", "records_tokenized", "records_cut", "records_skipped",
     "min", "p50", "p95", "max", "mean"}   once, before the weights load: the
                 token counts of the records tokenized by then.
    {"event": "eval", "step", "epoch", "eval_loss"}   after each epoch and at the
                 end, when eval_fraction > 0: the mean cross-entropy per answer
                 token over the held-out records.
    {"event": "checkpoint", "step", "path", "epoch"}   a complete checkpoint of
                 the state after optimizer step `step` is at `path` (see
                 Checkpoints). It may come a few steps after its step: the
                 writing is off the training loop.
    {"event": "done", "adapter_dir", "base_dir", "summary"}
    {"event": "error", "message"}
Anything else (warnings, tracebacks, library chatter) goes to stderr.

Exit status, each failure after an "error" line when it can:
    0    done.
    1    a failure of the job's own: a diverging loss, the base not on the
         Hub, an exception in training (its type is named), an out of
         memory (of its budget: a retry would fail the same way).
    2    bad input: parameters, data, the job file, a resume that does not
         fit the job; the line names what to change.
    3    a failure of the node, not the job's: a CUDA or driver error that
         is not an out of memory (`is_environment_failure`), no card where
         the agent chose one, the base not in the node's cache (offline),
         an OSError writing a checkpoint or the adapter. The job may be
         retried elsewhere.
    143  stopped by SIGTERM.

Checkpoints: with a checkpoint_dir, after every params.checkpoint_every_steps
optimizer steps and whenever params.checkpoint_every_s seconds passed since
the last one (`checkpoint_due`; never after the last step: the adapter is the
result then). The state is copied off the training (`take_snapshot`: only
the LoRA weights, never the base's) and written on a thread of its own
(`CheckpointWriter`) into <checkpoint_dir>/.tmp-step-NNNNNNNN/:
adapter_model.safetensors and adapter_config.json (a peft adapter directory
too), trainer_state.pt (optimizer, LR scheduler, GradScaler and RNG states:
python's, torch's CPU and, on a card, CUDA's; read back with
weights_only), each fsynced, then checkpoint.json last: {format 1, job_id,
step, epoch, position {epoch, index: steps done of that epoch's plan},
progress, fingerprint (data_sha256, model, total_steps and the parameters
but checkpoint_every_*, dtype), files {name: bytes}, time}. Then the
directory is renamed to step-NNNNNNNN, its parent fsynced, and only then
the "checkpoint" line printed. A crash leaves a .tmp-* directory (never
resumed from) or a complete checkpoint. The trainer never removes a
checkpoint (the agent removes superseded ones); a resumed run that passes
a step again replaces that step's checkpoint by its equal.

Data rendering: the tokenizer's chat template when it has one, else
PLAIN_TEMPLATE ("### Question:\\n{q}\\n\\n### Answer:\\n{a}{eos}"). {"q", "a"} is
[user q, assistant a]. Only the assistant's tokens carry loss (labels -100
elsewhere). Records longer than max_seq_len are cut and counted; a record with
no answer token left after the cut is skipped and counted.

Batches: each epoch shuffles the training records by seed + epoch, then sorts
each window of GROUP_WINDOW_BATCHES micro-batches' worth by token count (in
buckets of about 1/8) and cuts it into micro-batches of like lengths, shuffled
(`plan_grouped`): every record once an epoch, little padding. Records are
tokenized in batches, the template compiled once, and only when the plan first
needs them: with max_steps a job tokenizes the windows its steps read, not the
whole file.

What it writes: <out_dir>/adapter/{adapter_model.safetensors,
adapter_config.json, chat_template.jinja, training_summary.json}. The summary
(also the "done" line's) holds job_id, final_loss, eval_loss (null without a
held-out part), params, base {hf_repo, hf_revision, local_dir, base_dir},
data_sha256, records, records_train, records_eval, records_cut,
records_skipped (both of the records tokenized), records_tokenized (fewer than
records when max_steps ends the job before the data does), token_lengths
{min, p50, p95, max, mean} of those, chat_template ("tokenizer" | "plain"),
steps, epochs, tokens_seen (padding not counted), padding_tokens, train_time_s,
wall_time_s, peak_mib, device, dtype, trainable_parameters, versions {python, torch,
transformers, peft, accelerate, safetensors}, resumed_from (null, or {mode, dir,
step}: the checkpoint's step, 0 for "weights") and checkpoints (written by this
run). A resumed run's tokens_seen, train_time_s and steps count from step 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import random
import re
import resource
import shutil
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, cast

# --- the protocol -----------------------------------------------------------

#: Where protocol lines go: stdout, until `main` moves everything else off it.
_out: Any = sys.stdout
#: The checkpoint writer's thread prints its lines too: one line at a time.
_out_lock = threading.Lock()


def _own_stdout() -> None:
    """Keep fd 1 for protocol lines only: anything else (a library's print, C
    code writing to fd 1) is sent to stderr instead."""
    global _out
    sys.stdout.flush()
    _out = os.fdopen(os.dup(1), "w", encoding="utf-8", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr


def emit(event: str, **fields: Any) -> None:
    """Print one protocol line on stdout (and flush: the agent reads it live)."""
    fields["event"] = event
    line = json.dumps(fields, separators=(",", ":"), allow_nan=False) + "\n"
    with _out_lock:
        _out.write(line)
        _out.flush()


def log(message: str, level: str = "info") -> None:
    """A "log" line, also on stderr for a person reading the job's output."""
    emit("log", message=message, level=level)
    print(f"[trainer] {level}: {message}", file=sys.stderr, flush=True)


class BadInputError(Exception):
    """The job file, its parameters or its data are wrong: exit 2."""


class TrainingError(Exception):
    """Not the input's fault (a diverging loss, a base the Hub lacks): exit 1,
    the message shown as it is."""


class EnvironmentFailureError(Exception):
    """Not the job's fault: the node failed it (its card or driver, the disk a
    checkpoint goes to). Exit 3: the job may be retried elsewhere."""


class TerminatedError(BaseException):
    """SIGTERM arrived: stop now."""


# --- parameters ---------------------------------------------------------------

ROLES = ("system", "user", "assistant")


# BEGIN GENERATED PARAMS: python -m lorafleet_services.trainer.generate; do not edit
@dataclasses.dataclass(frozen=True)
class Params:
    """TrainerParams (lorafleet_schemas.messages), re-validated here: the script
    cannot trust its caller."""

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.05
    target_modules: list[str] | str = "all-linear"
    learning_rate: float = 0.0002
    lr_scheduler: str = "cosine"
    warmup_steps: int = 0
    epochs: int = 1
    max_steps: int = 0
    batch_size: int = 4
    gradient_accumulation: int = 1
    max_seq_len: int = 1024
    gradient_checkpointing: bool = False
    dtype: str = "auto"
    seed: int = 42
    eval_fraction: float = 0.1
    checkpoint_every_steps: int = 0
    checkpoint_every_s: float = 600.0


#: Each parameter's check: (kind, bounds). kind: int and float (bounds gt, ge,
#: lt, le), bool, choice (bounds: the values) or modules (a non-empty list of
#: module names, or the one word).
PARAM_RULES: dict[str, tuple[str, dict[str, Any]]] = {
    "rank": ("int", {"ge": 1, "le": 1024}),
    "alpha": ("float", {"gt": 0}),
    "dropout": ("float", {"ge": 0, "lt": 1}),
    "target_modules": ("modules", {"word": "all-linear"}),
    "learning_rate": ("float", {"gt": 0, "le": 1}),
    "lr_scheduler": ("choice", {"values": ("linear", "cosine", "constant")}),
    "warmup_steps": ("int", {"ge": 0}),
    "epochs": ("int", {"ge": 1, "le": 1000}),
    "max_steps": ("int", {"ge": 0}),
    "batch_size": ("int", {"ge": 1, "le": 4096}),
    "gradient_accumulation": ("int", {"ge": 1, "le": 4096}),
    "max_seq_len": ("int", {"ge": 8, "le": 1048576}),
    "gradient_checkpointing": ("bool", {}),
    "dtype": ("choice", {"values": ("auto", "bf16", "fp16", "fp32")}),
    "seed": ("int", {}),
    "eval_fraction": ("float", {"ge": 0, "lt": 1}),
    "checkpoint_every_steps": ("int", {"ge": 0}),
    "checkpoint_every_s": ("float", {"ge": 0}),
}
# END GENERATED PARAMS


@dataclasses.dataclass(frozen=True)
class Base:
    hf_repo: str | None
    hf_revision: str
    local_dir: str | None


@dataclasses.dataclass(frozen=True)
class Job:
    job_id: str
    base: Base
    data_path: Path
    data_sha256: str
    out_dir: Path
    params: Params
    device: str
    hf_offline: bool
    #: The card memory the whole process may use (CUDA context included); None: no cap.
    gpu_memory_mib: int | None = None
    #: The job's memory estimate, for the message when the budget is exceeded.
    estimate_mib: int | None = None
    #: Where checkpoints go (each a step-NNNNNNNN directory); None: none are written.
    checkpoint_dir: Path | None = None
    #: Where the job starts from, when not from scratch.
    resume: Resume | None = None


@dataclasses.dataclass(frozen=True)
class Resume:
    #: A checkpoint directory, a directory of them (the newest complete one is
    #: used) or, for "weights", a peft adapter directory.
    dir: Path
    #: "continue": the job's own checkpoint, everything restored, on from its
    #: step; "weights": only the adapter weights, the job trains from step 0.
    mode: str


RESUME_MODES = ("continue", "weights")


def parse_resume(raw: Any) -> Resume | None:
    """The job file's resume object (null: none)."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or set(raw) != {"dir", "mode"}:
        raise BadInputError(
            f'the job\'s resume is {raw!r}; it must be null or {{"dir": str, "mode": '
            '"continue" | "weights"}'
        )
    d = _str(raw, "dir")
    if raw["mode"] not in RESUME_MODES:
        raise BadInputError(
            f"the job's resume.mode is {raw['mode']!r}; it must be one of {RESUME_MODES}"
        )
    return Resume(dir=Path(str(d)), mode=raw["mode"])


def _int(name: str, v: Any, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadInputError(f"params.{name} is {v!r}; it must be an integer")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise BadInputError(f"params.{name} is {v}; it must be {_range(lo, hi)}")
    return v


def _float(
    name: str,
    v: Any,
    *,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise BadInputError(f"params.{name} is {v!r}; it must be a number")
    f = float(v)
    bad = (
        (gt is not None and not f > gt)
        or (ge is not None and not f >= ge)
        or (lt is not None and not f < lt)
        or (le is not None and not f <= le)
    )
    if bad:
        parts = [
            f"{op} {b:g}"
            for op, b in (("above", gt), ("at least", ge), ("below", lt), ("at most", le))
            if b is not None
        ]
        raise BadInputError(f"params.{name} is {v!r}; it must be {' and '.join(parts)}")
    return f


def _range(lo: int | None, hi: int | None) -> str:
    if lo is not None and hi is not None:
        return f"between {lo} and {hi}"
    return f"at least {lo}" if lo is not None else f"at most {hi}"


def _modules(name: str, v: Any, word: str) -> list[str] | str:
    if v == word:
        return word
    names_ok = (
        isinstance(v, list)
        and v
        and all(isinstance(m, str) and re.fullmatch(r"[A-Za-z0-9_.]+", m) for m in v)
    )
    if not names_ok:
        raise BadInputError(
            f'params.{name} is {v!r}; it must be "{word}" or a non-empty '
            "list of module names (q_proj, v_proj, ...)"
        )
    return list(v)


def _choice(name: str, v: Any, values: tuple[str, ...]) -> str:
    if v not in values:
        raise BadInputError(f"params.{name} is {v!r}; it must be one of {values}")
    return str(v)


def _bool(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise BadInputError(f"params.{name} is {v!r}; it must be true or false")
    return v


def _check_param(name: str, v: Any) -> Any:
    kind, bounds = PARAM_RULES[name]
    if kind == "int":
        return _int(name, v, bounds.get("ge"), bounds.get("le"))
    if kind == "float":
        return _float(name, v, **bounds)
    if kind == "choice":
        return _choice(name, v, bounds["values"])
    if kind == "modules":
        return _modules(name, v, bounds["word"])
    return _bool(name, v)


def parse_params(raw: Any) -> Params:
    """Validate the job's params object (missing keys take the defaults), by
    PARAM_RULES; the first bad one is named (the modules, choices and flags
    before the numbers)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise BadInputError(f"params is {type(raw).__name__}; it must be an object")
    known = {f.name for f in dataclasses.fields(Params)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise BadInputError(
            f"params.{unknown[0]} is not a trainer parameter; known: {', '.join(sorted(known))}"
        )
    d = Params()
    order = sorted(PARAM_RULES, key=lambda n: PARAM_RULES[n][0] in ("int", "float"))
    return Params(**{n: _check_param(n, raw.get(n, getattr(d, n))) for n in order})


def _str(raw: dict[str, Any], key: str, *, optional: bool = False) -> str | None:
    v = raw.get(key)
    if v is None and optional:
        return None
    if not isinstance(v, str) or not v:
        raise BadInputError(f"the job's {key} is {v!r}; it must be a non-empty string")
    return v


def parse_job(raw: Any) -> Job:
    """Validate the job file's object (see the module docstring)."""
    if not isinstance(raw, dict):
        raise BadInputError("the job file must hold a JSON object")
    base = raw.get("base")
    if not isinstance(base, dict):
        raise BadInputError("the job's base is missing; it must be an object")
    hf_repo = _str(base, "hf_repo", optional=True)
    local_dir = _str(base, "local_dir", optional=True)
    if (hf_repo is None) == (local_dir is None):
        raise BadInputError("the job's base needs exactly one of hf_repo and local_dir")
    revision = base.get("hf_revision") or "main"
    if not isinstance(revision, str):
        raise BadInputError(f"the job's base.hf_revision is {revision!r}; it must be a string")
    sha = _str(raw, "data_sha256") or ""
    if not re.fullmatch(r"[0-9a-f]{64}", sha):
        raise BadInputError(f"the job's data_sha256 is {sha!r}; it must be 64 lowercase hex digits")
    device = raw.get("device", "cuda")
    if device not in ("cuda", "cpu"):
        raise BadInputError(f'the job\'s device is {device!r}; it must be "cuda" or "cpu"')
    offline = raw.get("hf_offline", True)
    if not isinstance(offline, bool):
        raise BadInputError(f"the job's hf_offline is {offline!r}; it must be true or false")
    mibs = {k: raw.get(k) for k in ("gpu_memory_mib", "estimate_mib")}
    for key, v in mibs.items():
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise BadInputError(f"the job's {key} is {v!r}; it must be a positive integer or null")
    return Job(
        job_id=str(raw.get("job_id", "")),
        base=Base(hf_repo=hf_repo, hf_revision=revision, local_dir=local_dir),
        data_path=Path(str(_str(raw, "data_path"))),
        data_sha256=sha,
        out_dir=Path(str(_str(raw, "out_dir"))),
        params=parse_params(raw.get("params")),
        device=device,
        hf_offline=offline,
        gpu_memory_mib=mibs["gpu_memory_mib"],
        estimate_mib=mibs["estimate_mib"],
        checkpoint_dir=_path(_str(raw, "checkpoint_dir", optional=True)),
        resume=parse_resume(raw.get("resume")),
    )


def _path(v: str | None) -> Path | None:
    return None if v is None else Path(v)


# --- data -------------------------------------------------------------------

Conversation = list[dict[str, str]]


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def parse_record(line: str, lineno: int) -> Conversation:
    """One NDJSON line as a conversation; BadInputError naming the line otherwise."""
    where = f"data line {lineno}"
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise BadInputError(f"{where} is not JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(rec, dict):
        raise BadInputError(f'{where} is not an object; records are {{"q", "a"}} or {{"messages"}}')
    if "messages" in rec:
        extra = set(rec) - {"messages"}
        msgs = rec["messages"]
        if extra:
            raise BadInputError(f"{where} has {sorted(extra)} besides messages")
        if not isinstance(msgs, list) or not msgs:
            raise BadInputError(f"{where}: messages must be a non-empty list")
        conv: Conversation = []
        for i, m in enumerate(msgs):
            if (
                not isinstance(m, dict)
                or m.get("role") not in ROLES
                or not isinstance(m.get("content"), str)
            ):
                raise BadInputError(
                    f'{where}: messages[{i}] must be {{"role": one of {ROLES}, '
                    '"content": a string}'
                )
            conv.append({"role": m["role"], "content": m["content"]})
        if not any(m["role"] == "assistant" for m in conv):
            raise BadInputError(
                f"{where}: messages has no assistant message; there is nothing to learn from it"
            )
        return conv
    q, a = rec.get("q"), rec.get("a")
    if set(rec) != {"q", "a"} or not isinstance(q, str) or not isinstance(a, str):
        raise BadInputError(
            f'{where} must be {{"q": string, "a": string}} or {{"messages": [...]}}; '
            f"it has {sorted(rec)}"
        )
    if not a:
        raise BadInputError(f'{where}: "a" is empty; there is nothing to learn from it')
    return [{"role": "user", "content": q}, {"role": "assistant", "content": a}]


def load_records(path: Path, want_sha256: str) -> list[Conversation]:
    """The data file's records, after checking its sha256 against the job's."""
    return [conv for _, conv in load_numbered_records(path, want_sha256)]


def load_numbered_records(path: Path, want_sha256: str) -> list[tuple[int, Conversation]]:
    """(line number, record) of each non-blank line, after the sha256 check."""
    if not path.is_file():
        raise BadInputError(f"the data file {path} does not exist")
    got = file_sha256(path)
    if got != want_sha256:
        raise BadInputError(f"the data's sha256 is {got}, the job's is {want_sha256}")
    records: list[tuple[int, Conversation]] = []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                # A byte-order mark some editors write is not part of the record.
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError:
                raise BadInputError(f"data line {lineno} is not UTF-8") from None
            if line.strip():
                records.append((lineno, parse_record(line, lineno)))
    if not records:
        raise BadInputError(f"the data file {path} holds no records")
    return records


def split_records(n: int, eval_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, eval) record indices: a seeded shuffle, the first share held out.

    With eval_fraction > 0 at least one record is held out; at least one is
    always left to train on.
    """
    if eval_fraction <= 0:
        return list(range(n)), []
    k = max(1, round(n * eval_fraction))
    if n - k < 1:
        raise BadInputError(
            f"params.eval_fraction {eval_fraction:g} of {n} records leaves none to train on; "
            "lower it (0 holds none out) or add records"
        )
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return sorted(order[k:]), sorted(order[:k])


# --- rendering and label masking ------------------------------------------------

#: The template for tokenizers without one of their own (base models): one
#: "### System:" / "### Question:" / "### Answer:" block per message, blocks
#: separated by a blank line, each answer ended by the eos token, and a bos
#: token first when the tokenizer has one.
PLAIN_TEMPLATE = (
    "{% if bos_token %}{{ bos_token }}{% endif %}"
    "{% for message in messages %}"
    "{% if not loop.first %}{{ '\n\n' }}{% endif %}"
    "{% if message['role'] == 'system' %}{{ '### System:\n' + message['content'] }}"
    "{% elif message['role'] == 'user' %}{{ '### Question:\n' + message['content'] }}"
    "{% else %}{{ '### Answer:\n' + message['content'] + (eos_token or '') }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{% if messages %}{{ '\n\n' }}{% endif %}{{ '### Answer:\n' }}"
    "{% endif %}"
)

IGNORE = -100


@dataclasses.dataclass(frozen=True)
class Encoded:
    input_ids: list[int]
    #: IGNORE except on the assistant's tokens.
    labels: list[int]
    #: The record was longer than max_seq_len and was cut.
    cut: bool

    @property
    def answer_tokens(self) -> int:
        return sum(1 for x in self.labels if x != IGNORE)


def chat_template_of(tokenizer: Any) -> str:
    """The template the trainer renders with: the tokenizer's, else PLAIN_TEMPLATE."""
    t = getattr(tokenizer, "chat_template", None)
    if isinstance(t, dict):
        t = t.get("default") or next(iter(t.values()), None)
    return t if isinstance(t, str) and t else PLAIN_TEMPLATE


def _render(tokenizer: Any, template: str, msgs: Conversation, generation: bool) -> str:
    out = tokenizer.apply_chat_template(
        msgs, chat_template=template, tokenize=False, add_generation_prompt=generation
    )
    if not isinstance(out, str):
        raise TypeError(f"apply_chat_template answered {type(out).__name__}, not text")
    return out


#: Renders a conversation (with add_generation_prompt or not) as text.
Render = Callable[[Conversation, bool], str]


def renderer(tokenizer: Any, template: str) -> Render:
    """A render function for `template`, compiled once.

    apply_chat_template recompiles nothing but still costs tens of microseconds
    a call in argument handling, and a record takes three calls. The compiled
    template (transformers' own compiler, so the same sandbox and filters) is
    rendered directly with the tokenizer's special tokens; the first 16 calls
    are checked against apply_chat_template and on any difference (or a
    transformers without the compiler) every call goes through it instead.
    """

    def slow(msgs: Conversation, generation: bool) -> str:
        return _render(tokenizer, template, msgs, generation)

    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        compiled = _compile_jinja_template(template)
        kwargs = dict(tokenizer.special_tokens_map)
    except Exception:
        return slow
    state: dict[str, Any] = {"checks_left": 16, "fast": True}

    def fast(msgs: Conversation, generation: bool) -> str:
        if not state["fast"]:
            return slow(msgs, generation)
        text = str(
            compiled.render(
                messages=msgs,
                tools=None,
                documents=None,
                add_generation_prompt=generation,
                **kwargs,
            )
        )
        if state["checks_left"]:
            state["checks_left"] -= 1
            if text != slow(msgs, generation):
                state["fast"] = False
                return slow(msgs, generation)
        return text

    return fast


def segments(tokenizer: Any, template: str, conv: Conversation) -> list[tuple[str, bool]]:
    """`segments_with` rendering by apply_chat_template, call by call."""
    return segments_with(lambda msgs, gen: _render(tokenizer, template, msgs, gen), conv)


def segments_with(render: Render, conv: Conversation) -> list[tuple[str, bool]]:
    """The rendered conversation as (text, trained) pieces; trained = an assistant turn.

    Each assistant turn's text is what rendering it adds after the prompt that
    asks for it (the conversation so far with add_generation_prompt). A
    template whose renderings are not prefixes of each other (some drop past
    reasoning) trains on the last answer only.
    """
    pieces: list[tuple[str, bool]] = []
    done = ""
    ok = True
    for i, m in enumerate(conv):
        if m["role"] != "assistant":
            continue
        prompt = render(conv[:i], True)
        full = render(conv[: i + 1], False)
        if not (prompt.startswith(done) and full.startswith(prompt)):
            ok = False
            break
        pieces += [(prompt[len(done) :], False), (full[len(prompt) :], True)]
        done = full
    if ok:
        end = render(conv, False)
        if end.startswith(done):
            pieces.append((end[len(done) :], False))
            return [(t, trained) for t, trained in pieces if t]
    last = max(i for i, m in enumerate(conv) if m["role"] == "assistant")
    prompt = render(conv[:last], True)
    full = render(conv[: last + 1], False)
    k = 0
    while k < min(len(prompt), len(full)) and prompt[k] == full[k]:
        k += 1
    return [(t, trained) for t, trained in ((full[:k], False), (full[k:], True)) if t]


def encode_conversation(
    tokenizer: Any, template: str, conv: Conversation, max_seq_len: int
) -> Encoded:
    """Token ids and labels of one conversation, cut at max_seq_len tokens.

    Each piece is tokenized on its own (no special tokens added: the template
    writes them), so the prompt/answer boundary is exact.
    """
    ids: list[int] = []
    labels: list[int] = []
    for text, trained in segments(tokenizer, template, conv):
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        labels += piece if trained else [IGNORE] * len(piece)
    cut = len(ids) > max_seq_len
    return Encoded(ids[:max_seq_len], labels[:max_seq_len], cut)


#: The most threads a batched tokenizer call uses: the node's cores are shared
#: with the engines beside the trainer, and the burst lasts seconds.
TOKENIZER_THREADS = 8


@contextlib.contextmanager
def _parallel_tokenizing() -> Iterator[None]:
    """The fast tokenizer's own thread pool on for one batched call.

    The agent turns TOKENIZERS_PARALLELISM off for the whole trainer (a
    process that forks after using the pool may deadlock); the trainer never
    forks, so a batched call may use up to TOKENIZER_THREADS cores (the pool's
    size is read once, at its first use).
    """
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ.setdefault("RAYON_NUM_THREADS", str(min(TOKENIZER_THREADS, os.cpu_count() or 1)))
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved


def encode_many(
    tokenizer: Any, template: str, records: Sequence[tuple[int, Conversation]], max_seq_len: int
) -> list[Encoded]:
    """`encode_conversation` of each (line number, record), the same tokens, in
    one pass: the template compiled once, then every record's pieces tokenized
    in one batched call (the fast tokenizer's Rust loop, not a Python call a
    piece)."""
    render = renderer(tokenizer, template)
    texts: list[str] = []
    trained: list[bool] = []
    counts: list[int] = []
    for lineno, conv in records:
        try:
            pieces = segments_with(render, conv)
        except Exception as e:
            raise BadInputError(
                f"data line {lineno} cannot be rendered with the model's chat template: "
                f"{type(e).__name__}: {e}"
            ) from e
        texts += [t for t, _ in pieces]
        trained += [x for _, x in pieces]
        counts.append(len(pieces))
    with _parallel_tokenizing():
        ids_of = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    out: list[Encoded] = []
    k = 0
    for n in counts:
        ids: list[int] = []
        labels: list[int] = []
        for piece, is_trained in zip(ids_of[k : k + n], trained[k : k + n], strict=True):
            ids += piece
            labels += piece if is_trained else [IGNORE] * len(piece)
        k += n
        out.append(Encoded(ids[:max_seq_len], labels[:max_seq_len], len(ids) > max_seq_len))
    return out


class Tokens:
    """The records' token ids, made when first asked for, a batch at a time.

    Only what the plan reads is tokenized: with max_steps a few windows of
    the first epoch, not the whole file. `cut` and `skipped` count the records
    tokenized so far (skipped: no answer token left within max_seq_len).
    """

    #: Records a batched call tokenizes at most, so progress shows between calls.
    CHUNK = 4096

    def __init__(
        self,
        tokenizer: Any,
        template: str,
        records: Sequence[tuple[int, Conversation]],
        max_seq_len: int,
        on_progress: Callable[[int], None] = lambda done: None,
    ) -> None:
        self._tokenizer = tokenizer
        self._template = template
        self._records = records
        self._max_seq_len = max_seq_len
        self.on_progress = on_progress
        self._encoded: dict[int, Encoded] = {}
        self.cut = 0
        self.skipped = 0

    def get(self, indices: Sequence[int]) -> list[Encoded]:
        """The records at `indices` (of the data file's records), tokenizing the missing."""
        missing = sorted({i for i in indices if i not in self._encoded})
        for c in range(0, len(missing), self.CHUNK):
            chunk = missing[c : c + self.CHUNK]
            encoded = encode_many(
                self._tokenizer,
                self._template,
                [self._records[i] for i in chunk],
                self._max_seq_len,
            )
            for i, e in zip(chunk, encoded, strict=True):
                self._encoded[i] = e
                self.cut += e.cut
                self.skipped += e.answer_tokens == 0
            self.on_progress(len(self._encoded))
        return [self._encoded[i] for i in indices]

    def lengths(self, indices: Sequence[int]) -> list[int]:
        """Each record's token count, 0 for one with no answer token (skipped)."""
        return [len(e.input_ids) if e.answer_tokens else 0 for e in self.get(indices)]

    @property
    def done(self) -> int:
        return len(self._encoded)

    def length_summary(self) -> dict[str, int]:
        """min, p50, p95, max and mean token count of the records tokenized so far."""
        lengths = sorted(len(e.input_ids) for e in self._encoded.values())
        if not lengths:
            return {}

        def at(q: float) -> int:
            return lengths[min(len(lengths) - 1, int(q * len(lengths)))]

        return {
            "min": lengths[0],
            "p50": at(0.5),
            "p95": at(0.95),
            "max": lengths[-1],
            "mean": round(sum(lengths) / len(lengths)),
        }


# --- batches ----------------------------------------------------------------


def plan_steps(
    n_train: int, batch_size: int, accumulation: int, epoch_seed: int
) -> list[list[list[int]]]:
    """One epoch: optimizer steps, each a list of micro-batches of record indices.

    Records are shuffled with `epoch_seed`; the last step may hold fewer
    micro-batches, the last micro-batch fewer records.
    """
    order = list(range(n_train))
    random.Random(epoch_seed).shuffle(order)
    micro = [order[i : i + batch_size] for i in range(0, n_train, batch_size)]
    return [micro[i : i + accumulation] for i in range(0, len(micro), accumulation)]


#: Micro-batches' worth of records sorted by length together: the wider, the
#: less padding, the narrower, the more random the batches' order. 64 leaves
#: padding at a few percent of a long-tailed length distribution.
GROUP_WINDOW_BATCHES = 64


def _bucket(length: int) -> int:
    """Lengths within about 1/8 of each other share a bucket (tens of tokens
    apart share one of 8): batches mix records a little more than a strict
    sort would, for at most about 12% padding."""
    step = max(8, 1 << max(0, length.bit_length() - 4))
    return (length + step - 1) // step * step


def plan_grouped(
    train: Sequence[int],
    batch_size: int,
    accumulation: int,
    epoch_seed: int,
    lengths_of: Callable[[Sequence[int]], list[int]],
    max_steps: int = 0,
) -> list[list[list[int]]]:
    """One epoch of length-grouped batches: optimizer steps, each a list of
    micro-batches of the `train` record indices.

    The records are shuffled with `epoch_seed`, then taken a window of
    GROUP_WINDOW_BATCHES micro-batches at a time: a window is sorted by token
    count (`lengths_of`, 0 for a record to skip) in buckets of about 1/8
    (`_bucket`) and cut into micro-batches of like lengths, which are shuffled
    (so one step does not hold all the long ones). A strict sort would put the
    same records together every epoch when lengths are alike: on the demo's
    data it ended 3% above random batches' held-out loss in 5 of 5 seeds, the
    buckets 0.7% below (4 of 5). The records left over from a window's last,
    part-filled micro-batch go into the next window: every record once an
    epoch, ceil(records / batch_size) micro-batches, only the last one short.
    With max_steps, windows are read (and so tokenized) only until that many
    steps are planned.
    """
    rng = random.Random(epoch_seed)
    order = list(train)
    rng.shuffle(order)
    window = batch_size * GROUP_WINDOW_BATCHES
    micro: list[list[int]] = []
    carry: list[tuple[int, int]] = []
    for w in range(0, len(order), window):
        ids = order[w : w + window]
        pool = carry + [(n, i) for n, i in zip(lengths_of(ids), ids, strict=True) if n > 0]
        pool.sort(key=lambda x: _bucket(x[0]))  # stable: a bucket keeps its shuffled order
        full = len(pool) - len(pool) % batch_size
        batches = [[i for _, i in pool[j : j + batch_size]] for j in range(0, full, batch_size)]
        carry = pool[full:]
        rng.shuffle(batches)
        micro += batches
        if max_steps and len(micro) >= max_steps * accumulation:
            carry = []
            break
    if carry:
        micro.append([i for _, i in carry])
    steps = [micro[i : i + accumulation] for i in range(0, len(micro), accumulation)]
    return steps[:max_steps] if max_steps else steps


def collate(encoded: Sequence[Encoded], pad_id: int) -> tuple[list[list[int]], ...]:
    """Right-padded (input_ids, attention_mask, labels) as lists."""
    width = max(len(e.input_ids) for e in encoded)
    ids, mask, labels = [], [], []
    for e in encoded:
        pad = width - len(e.input_ids)
        ids.append(e.input_ids + [pad_id] * pad)
        mask.append([1] * len(e.input_ids) + [0] * pad)
        labels.append(e.labels + [IGNORE] * pad)
    return ids, mask, labels


@dataclasses.dataclass
class Batch:
    """A micro-batch as tensors on the training device."""

    input_ids: Any
    #: None when no record in the batch is padded.
    attention_mask: Any
    labels: Any
    #: Real tokens (padding not counted).
    tokens: int
    #: Padding tokens the batch computes on for nothing.
    padding: int = 0


def to_batch(encoded: Sequence[Encoded], pad_id: int, device: Any) -> Batch:
    """A micro-batch on `device`. For a card the tensors are made in pinned host
    memory and copied without blocking: a copy from ordinary memory would wait
    for the card to finish the work queued before it, and the next step's
    batches are made while the card still runs this one (see train_steps)."""
    import torch

    ids, mask, labels = collate(encoded, pad_id)
    t_ids, t_mask, t_labels = (torch.tensor(x, dtype=torch.long) for x in (ids, mask, labels))
    if device.type == "cuda":
        t_ids, t_mask, t_labels = (
            t.pin_memory().to(device, non_blocking=True) for t in (t_ids, t_mask, t_labels)
        )
    # Without padding no mask is needed, and none spares transformers a check of
    # the mask's values that would wait for the card on every forward.
    no_padding = len({len(e.input_ids) for e in encoded}) == 1
    return Batch(
        t_ids,
        None if no_padding else t_mask,
        t_labels,
        tokens=sum(len(e.input_ids) for e in encoded),
        padding=len(ids) * len(ids[0]) - sum(len(e.input_ids) for e in encoded),
    )


# --- training ---------------------------------------------------------------


@dataclasses.dataclass
class Loop:
    """What the training loop needs, built by `prepare_training`."""

    model: Any
    optimizer: Any
    scheduler: Any
    scaler: Any
    autocast: Callable[[], contextlib.AbstractContextManager[Any]]
    device: Any


@dataclasses.dataclass
class Progress:
    step: int = 0
    tokens: int = 0
    padding: int = 0
    train_s: float = 0.0
    last_loss: float | None = None
    last_eval: float | None = None


def peak_mib(device: Any) -> int:
    """torch's peak reserved MiB on a card; the process's peak RSS MiB on the CPU."""
    if device.type == "cuda":
        import torch

        return int(torch.cuda.max_memory_reserved(device) // (1 << 20))
    # Linux reports ru_maxrss in KiB.
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)


def _accumulate(loop: Loop, micro: list[Batch]) -> Any:
    """Forward and backward over one step's micro-batches; answers the step's
    loss as a tensor (still on the card: reading it would wait for the card)."""
    n = len(micro)
    total = None
    for b in micro:
        with loop.autocast():
            out = loop.model(
                input_ids=b.input_ids, attention_mask=b.attention_mask, labels=b.labels
            )
        loss = out.loss / n
        if loop.scaler is not None:
            loop.scaler.scale(loss).backward()
        else:
            loss.backward()
        d = loss.detach()
        total = d if total is None else total + d
    if total is None:
        raise TrainingError("a step with no micro-batch: the data plan is empty")
    return total


def _optimizer_step(loop: Loop) -> None:
    if loop.scaler is not None:
        loop.scaler.step(loop.optimizer)
        loop.scaler.update()
    else:
        loop.optimizer.step()
    loop.scheduler.step()
    loop.optimizer.zero_grad(set_to_none=True)


def train_steps(
    loop: Loop,
    steps_plan: Iterator[tuple[int, list[Batch]]],
    total_steps: int,
    progress: Progress,
    on_step: Callable[[dict[str, Any]], None],
) -> None:
    """Run optimizer steps from `steps_plan` ((epoch, micro-batches) per step).

    The only host sync per step is the loss's .item(), after the optimizer step
    and after the next step's batches are made (they overlap the card's work).
    A step's time runs from the end of the one before, so that making its
    batches and reporting count too (tokens/s is what the job really gets).
    """
    t0 = time.perf_counter()
    upcoming = next(steps_plan, None)
    while upcoming is not None:
        epoch, micro = upcoming
        lr = loop.scheduler.get_last_lr()[0]
        total = _accumulate(loop, micro)
        _optimizer_step(loop)
        # On a card all of the above is only queued: make the next step's
        # batches now, while it runs, then wait for the loss.
        upcoming = next(steps_plan, None)
        step_loss = float(total.item())
        if not math.isfinite(step_loss):
            raise TrainingError(
                f"the loss became {step_loss} at step {progress.step + 1}; "
                "lower learning_rate, or train in bf16 or fp32"
            )
        now = time.perf_counter()
        dt, t0 = now - t0, now
        tokens = sum(b.tokens for b in micro)
        progress.step += 1
        progress.tokens += tokens
        progress.padding += sum(b.padding for b in micro)
        progress.train_s += dt
        progress.last_loss = step_loss
        on_step(
            {
                "step": progress.step,
                "steps": total_steps,
                "loss": step_loss,
                "learning_rate": float(lr),
                "tokens_per_s": round(tokens / dt, 1) if dt > 0 else 0.0,
                "eta_s": round(progress.train_s / progress.step * (total_steps - progress.step), 2),
                "peak_mib": peak_mib(loop.device),
                "epoch": epoch,
            }
        )


def eval_loss(loop: Loop, batches: Sequence[Batch]) -> float:
    """Mean cross-entropy per answer token over `batches` (dropout off)."""
    import torch
    import torch.nn.functional as F

    model = loop.model
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=loop.device)
    count = 0
    with torch.no_grad():
        for b in batches:
            with loop.autocast():
                logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits
            shift_logits = logits[:, :-1, :].float()
            shift_labels = b.labels[:, 1:]
            total += F.cross_entropy(
                shift_logits.reshape(-1, shift_logits.shape[-1]),
                shift_labels.reshape(-1),
                ignore_index=IGNORE,
                reduction="sum",
            ).double()
            count += int((shift_labels != IGNORE).sum().item())
    model.train()
    return float(total.item()) / max(count, 1)


def resolve_dtype(requested: str, device: str) -> str:
    """The dtype to train in ("bf16", "fp16" or "fp32") on `device` ("cpu" or "cuda").

    BadInputError when the device cannot train so. On the CPU this needs no
    torch (it runs before anything is loaded).
    """
    if device == "cpu":
        if requested == "fp16":
            raise BadInputError(
                'params.dtype "fp16" needs a card; on the CPU use "fp32", "bf16" or "auto"'
            )
        return "fp32" if requested == "auto" else requested
    import torch

    bf16_ok = bool(torch.cuda.is_bf16_supported())
    if requested == "auto":
        return "bf16" if bf16_ok else "fp16"
    if requested == "bf16" and not bf16_ok:
        raise BadInputError(
            'params.dtype "bf16" is not supported by this card; use "fp16", "fp32" or "auto"'
        )
    return requested


def torch_dtype(name: str) -> Any:
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def prepare_training(model: Any, params: Params, dtype: str, device: Any, total_steps: int) -> Loop:
    """Wrap `model` with LoRA (peft) and build the optimizer, scheduler and autocast."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import get_scheduler

    if params.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
        model.config.use_cache = False
    config = LoraConfig(
        r=params.rank,
        # peft annotates an int, but scales by alpha / r: a float alpha is fine.
        lora_alpha=cast(Any, params.alpha),
        lora_dropout=params.dropout,
        target_modules=params.target_modules,
        task_type="CAUSAL_LM",
    )
    # peft keeps the adapter's weights in fp32 under a bf16/fp16 base
    # (autocast_adapter_dtype), which is what lets fp16 gradients be unscaled.
    model = get_peft_model(model, config)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=params.learning_rate)
    sched = get_scheduler(
        params.lr_scheduler,
        optimizer=opt,
        num_warmup_steps=params.warmup_steps,
        num_training_steps=total_steps,
    )
    scaler = torch.amp.GradScaler("cuda") if dtype == "fp16" else None
    if dtype == "fp32":

        def autocast() -> contextlib.AbstractContextManager[Any]:
            return contextlib.nullcontext()

    else:
        amp = torch_dtype(dtype)

        def autocast() -> contextlib.AbstractContextManager[Any]:
            return torch.autocast(device_type=device.type, dtype=amp)

    return Loop(model, opt, sched, scaler, autocast, device)


# --- checkpoints --------------------------------------------------------------

#: checkpoint.json's "format": a reader refuses any other.
CHECKPOINT_FORMAT = 1
CHECKPOINT_META = "checkpoint.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
#: The optimizer, LR scheduler, GradScaler and RNG states (torch.save; read
#: back with weights_only: no code runs on load).
TRAINER_STATE = "trainer_state.pt"
#: A checkpoint being written; never one to resume from.
TMP_PREFIX = ".tmp-"
#: The parameters a checkpoint's trajectory does not depend on: a "continue"
#: may change them (more or fewer checkpoints, another card's dtype).
FINGERPRINT_EXCLUDED = ("checkpoint_every_steps", "checkpoint_every_s", "dtype")


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def checkpoint_due(
    step: int, total_steps: int, every_steps: int, every_s: float, since_s: float
) -> bool:
    """Whether to checkpoint after optimizer step `step`: every `every_steps`
    steps, or once `every_s` seconds passed since the last checkpoint (or the
    start); never after the last step (the adapter is the result then)."""
    if step >= total_steps:
        return False
    if every_steps > 0 and step % every_steps == 0:
        return True
    return every_s > 0 and since_s >= every_s


def fingerprint_of(job: Job, total_steps: int) -> dict[str, Any]:
    """What a checkpoint's state depends on, as JSON: a "continue" must match
    it (the data plan is rebuilt from it, the optimizer's state assumes it)."""
    base = job.base
    model = f"{base.hf_repo}@{base.hf_revision}" if base.hf_repo else str(base.local_dir)
    params = {
        k: v for k, v in dataclasses.asdict(job.params).items() if k not in FINGERPRINT_EXCLUDED
    }
    out = {"data_sha256": job.data_sha256, "model": model, "total_steps": total_steps, **params}
    return cast(dict[str, Any], json.loads(json.dumps(out)))


def fingerprint_differences(saved: Any, ours: dict[str, Any]) -> list[str]:
    """What differs between a checkpoint's fingerprint and this job's, by name."""
    if not isinstance(saved, dict):
        return ["its fingerprint is missing"]
    return [
        f"{k} {json.dumps(saved.get(k))} there, {json.dumps(ours.get(k))} here"
        for k in sorted(set(saved) | set(ours))
        if saved.get(k) != ours.get(k)
    ]


@dataclasses.dataclass
class Snapshot:
    """A checkpoint's content, copied off the training state at a step (so the
    training can go on while it is written)."""

    weights: dict[str, Any]
    state: dict[str, Any]
    adapter_config: str
    meta: dict[str, Any]


def _cpu_copy(obj: Any) -> Any:
    """`obj` with every tensor copied to the CPU (the optimizer updates its
    state in place: a reference would be written as it is some steps later)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_cpu_copy(v) for v in obj)
    return obj


def adapter_config_json(model: Any) -> str:
    """adapter_config.json as peft's save_pretrained writes it (sets as lists)."""
    config = model.peft_config["default"].to_dict()
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
    return json.dumps(config, indent=2, sort_keys=True)


def take_snapshot(
    loop: Loop, progress: Progress, epoch: int, index: int, meta: dict[str, Any]
) -> Snapshot:
    """The state after optimizer step progress.step, `index` steps into `epoch`'s plan."""
    import torch
    from peft import get_peft_model_state_dict

    weights = {
        k: v.detach().to("cpu", copy=True).contiguous()
        for k, v in get_peft_model_state_dict(loop.model).items()
    }
    rng: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if loop.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state_all()
    state = {
        "optimizer": _cpu_copy(loop.optimizer.state_dict()),
        "scheduler": _cpu_copy(loop.scheduler.state_dict()),
        "scaler": None if loop.scaler is None else _cpu_copy(loop.scaler.state_dict()),
        "rng": rng,
    }
    return Snapshot(
        weights,
        state,
        adapter_config_json(loop.model),
        {
            **meta,
            "format": CHECKPOINT_FORMAT,
            "step": progress.step,
            "epoch": epoch,
            "position": {"epoch": epoch, "index": index},
            "progress": dataclasses.asdict(progress),
        },
    )


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_checkpoint(parent: Path, snap: Snapshot) -> Path:
    """Write `snap` into parent/.tmp-step-N, synced, checkpoint.json last, then
    rename it to parent/step-N: a crash at any point leaves either no step-N or
    a complete one. Answers its path."""
    import torch
    from safetensors.torch import save_file

    name = checkpoint_name(int(snap.meta["step"]))
    tmp, final = parent / (TMP_PREFIX + name), parent / name
    if tmp.exists():  # a write of this step cut short, by a crash
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_file(snap.weights, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    torch.save(snap.state, tmp / TRAINER_STATE)
    (tmp / ADAPTER_CONFIG).write_text(snap.adapter_config, encoding="utf-8")
    files = {}
    for f in (ADAPTER_WEIGHTS, TRAINER_STATE, ADAPTER_CONFIG):
        # Readable by the agent, which may run as another user than the trainer.
        os.chmod(tmp / f, 0o644)
        _fsync(tmp / f)
        files[f] = (tmp / f).stat().st_size
    meta = {**snap.meta, "files": files, "time": round(time.time(), 3)}
    with (tmp / CHECKPOINT_META).open("w", encoding="utf-8") as fh:
        fh.write(json.dumps(meta, indent=2) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    _fsync(tmp)
    if final.exists():
        # The same step again (a run resumed from an earlier one passed it):
        # its state is the same; the old copy goes aside, then away.
        old = parent / (TMP_PREFIX + "old-" + name)
        if old.exists():
            shutil.rmtree(old)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    _fsync(parent)
    return final


class CheckpointWriter:
    """Writes snapshots on a thread of its own, one at a time, and prints each
    one's "checkpoint" line once it is complete. The training waits only for
    the copy of its state (`take_snapshot`) and, when checkpoints come faster
    than the disk takes them, for the previous write."""

    def __init__(self, parent: Path) -> None:
        self.parent = parent
        self.written = 0
        self._thread: threading.Thread | None = None
        self._failure: tuple[int, BaseException] | None = None

    def submit(self, snap: Snapshot) -> None:
        self.wait()
        self._thread = threading.Thread(
            target=self._write, args=(snap,), name="checkpoint-writer", daemon=True
        )
        self._thread.start()

    def _write(self, snap: Snapshot) -> None:
        try:
            path = write_checkpoint(self.parent, snap)
        except BaseException as e:
            self._failure = (int(snap.meta["step"]), e)
            return
        self.written += 1
        emit("checkpoint", step=snap.meta["step"], path=str(path), epoch=snap.meta["epoch"])

    def check(self) -> None:
        """Raise a finished write's failure (called every step: cheap)."""
        if self._thread is not None and not self._thread.is_alive():
            self.wait()

    def wait(self) -> None:
        """Wait for the write in flight; raise its failure: an OSError is the
        node's (its disk), EnvironmentFailureError; anything else as it is."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._failure is None:
            return
        step, e = self._failure
        self._failure = None
        if isinstance(e, OSError):
            raise EnvironmentFailureError(
                f"writing the checkpoint of step {step} into {self.parent} failed: "
                f"{type(e).__name__}: {e}"
            ) from e
        raise e


class Checkpointer:
    """When to checkpoint (`checkpoint_due`) and what (`take_snapshot`), after
    each optimizer step; the writing is the CheckpointWriter's."""

    def __init__(self, parent: Path, p: Params, total_steps: int, meta: dict[str, Any]) -> None:
        self.every_steps = p.checkpoint_every_steps
        self.every_s = p.checkpoint_every_s
        self.total_steps = total_steps
        self.meta = meta
        self.writer = CheckpointWriter(parent)
        self._last = time.monotonic()

    def after_step(self, loop: Loop, progress: Progress, epoch: int, index: int) -> None:
        self.writer.check()
        now = time.monotonic()
        if checkpoint_due(
            progress.step, self.total_steps, self.every_steps, self.every_s, now - self._last
        ):
            # The write before first: one snapshot in host memory at a time.
            self.writer.wait()
            self.writer.submit(take_snapshot(loop, progress, epoch, index, self.meta))
            self._last = now

    def close(self) -> None:
        self.writer.wait()


def open_checkpoint_dir(path: Path) -> None:
    """Create the checkpoint directory and clear what crashed writes left in it
    (.tmp-* directories: never checkpoints). Up front, so a disk that cannot
    take checkpoints fails the job before it trains."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        for d in path.glob(TMP_PREFIX + "*"):
            shutil.rmtree(d) if d.is_dir() else d.unlink()
    except OSError as e:
        raise EnvironmentFailureError(
            f"the checkpoint directory {path} cannot be written: {type(e).__name__}: {e}"
        ) from e


# --- resuming -----------------------------------------------------------------


def read_checkpoint_meta(d: Path) -> dict[str, Any]:
    """A complete checkpoint's checkpoint.json, checked (format, step, position,
    its files and their sizes); BadInputError saying what is wrong otherwise."""
    if d.name.startswith(TMP_PREFIX):
        raise BadInputError(
            f"{d} is a checkpoint that was still being written ({TMP_PREFIX}* directories "
            "are incomplete); resume from a step-* directory"
        )
    path = d / CHECKPOINT_META
    if not path.is_file():
        raise BadInputError(
            f"{d} has no {CHECKPOINT_META}: it is not a complete checkpoint (the trainer writes "
            "that file last)"
        )
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadInputError(f"{path} is not JSON: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != CHECKPOINT_FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else meta
        raise BadInputError(
            f"{path} has format {got!r}; this trainer reads format {CHECKPOINT_FORMAT}"
        )
    step, pos = meta.get("step"), meta.get("position")
    valid = (
        isinstance(step, int)
        and step >= 1
        and isinstance(pos, dict)
        and all(isinstance(pos.get(k), int) for k in ("epoch", "index"))
        and pos["epoch"] >= 1
        and 0 <= pos["index"] <= step
        and isinstance(meta.get("files"), dict)
        and isinstance(meta.get("progress"), dict)
    )
    if not valid:
        raise BadInputError(f"{path} lacks a valid step, position, progress or files list")
    for name, size in meta["files"].items():
        f = d / str(name)
        if not f.is_file() or f.stat().st_size != size:
            raise BadInputError(f"{f} is missing or not the {size} bytes {path} lists")
    return meta


def locate_checkpoint(d: Path) -> Path:
    """`d` itself when it holds checkpoint.json (or is a .tmp-* directory, to be
    refused by name); else the newest complete step-* directory inside it."""
    if not d.is_dir():
        raise BadInputError(f"the job's resume.dir {d} is not a directory")
    if d.name.startswith(TMP_PREFIX) or (d / CHECKPOINT_META).exists():
        return d
    for c in sorted(d.glob("step-*"), reverse=True):
        if (c / CHECKPOINT_META).is_file():
            return c
    return d  # refused by read_checkpoint_meta: no checkpoint.json


def resume_source(r: Resume) -> tuple[Path, dict[str, Any] | None]:
    """The directory to read and its checkpoint.json (None: a peft adapter
    directory, for "weights" only)."""
    adapter_dir = (
        r.mode == "weights"
        and not r.dir.name.startswith(TMP_PREFIX)
        and not (r.dir / CHECKPOINT_META).exists()
        and (r.dir / ADAPTER_WEIGHTS).is_file()
    )
    if adapter_dir:
        return r.dir, None
    d = locate_checkpoint(r.dir)
    return d, read_checkpoint_meta(d)


def load_adapter_weights(model: Any, d: Path, device: Any) -> None:
    """Copy d/adapter_model.safetensors into the LoRA weights of `model`;
    BadInputError when its modules or shapes differ (another rank or targets)."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file

    try:
        loaded = load_file(str(d / ADAPTER_WEIGHTS))
    except Exception as e:
        raise BadInputError(f"{d / ADAPTER_WEIGHTS} cannot be read: {type(e).__name__}: {e}") from e
    ours = {k: tuple(v.shape) for k, v in get_peft_model_state_dict(model).items()}
    theirs = {k: tuple(v.shape) for k, v in loaded.items()}
    if ours != theirs:
        raise BadInputError(
            f"the adapter in {d} does not fit this job's LoRA: it has {_lora_shape(theirs)}, "
            f"this job {_lora_shape(ours)}; params.rank and params.target_modules must be "
            "the ones it was trained with"
        )
    set_peft_model_state_dict(model, {k: v.to(device) for k, v in loaded.items()})


def _lora_shape(shapes: dict[str, tuple[int, ...]]) -> str:
    a = {s[0] for k, s in shapes.items() if k.endswith("lora_A.weight")}
    ranks = "/".join(str(r) for r in sorted(a)) or "no"
    modules = len([k for k in shapes if k.endswith("lora_A.weight")])
    return f"rank {ranks} on {modules} modules"


def restore_training_state(loop: Loop, d: Path, meta: dict[str, Any]) -> tuple[Progress, Any]:
    """The optimizer, LR scheduler and GradScaler states of checkpoint `d`
    into `loop`; answers its progress and its RNG states (restored last,
    just before the next step, by `restore_rng`)."""
    import torch

    state = torch.load(d / TRAINER_STATE, map_location="cpu", weights_only=True)
    loop.optimizer.load_state_dict(state["optimizer"])
    loop.scheduler.load_state_dict(state["scheduler"])
    if loop.scaler is not None and state.get("scaler"):
        loop.scaler.load_state_dict(state["scaler"])
    fields = {f.name for f in dataclasses.fields(Progress)}
    progress = Progress(**{k: v for k, v in meta["progress"].items() if k in fields})
    return progress, state["rng"]


def restore_rng(rng: dict[str, Any], device: Any) -> None:
    """The RNG states of the checkpoint: dropout draws on from where it was."""
    import torch

    python = rng["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))
    torch.set_rng_state(rng["torch"])
    if device.type == "cuda" and rng.get("cuda"):
        torch.cuda.set_rng_state_all(rng["cuda"])


# --- the card's budget ---------------------------------------------------------

MIB = 1 << 20

#: The least the CUDA context is taken to be (lorafleet.estimate.CUDA_CONTEXT_MIB,
#: the same figure): measured right after start it is smaller, but kernels
#: loaded lazily on first use grow it during the first steps.
CUDA_CONTEXT_MIB = 512


def memory_fraction(budget_mib: int, context_mib: int, total_bytes: int) -> float:
    """The share of the card torch's allocator may take so that the whole
    process (the CUDA context NVML counts, and torch's tensors) stays within
    `budget_mib`. BadInputError when the context alone fills the budget."""
    allowed = (budget_mib - context_mib) * MIB
    if allowed <= 0:
        raise BadInputError(
            f"gpu_memory_mib {budget_mib} leaves nothing for the training: the CUDA context "
            f"alone takes {context_mib} MiB; give the job more gpu_memory_mib"
        )
    return min(1.0, allowed / total_bytes)


def process_card_mib(device_index: int, pid: int) -> int | None:
    """This process's card memory as NVML counts it, or None when NVML cannot
    tell (no nvidia-ml-py, or a container whose process ids NVML does not see)."""
    import torch

    try:
        text = torch.cuda.list_gpu_processes(device_index)
    except Exception:
        return None
    m = re.search(rf"process\s+{pid}\s+uses\s+([\d.]+)\s+MB", text)
    return round(float(m.group(1))) if m else None


def cap_card_memory(device: Any, budget_mib: int) -> str:
    """Cap torch's allocator on `device` to the job's budget less the CUDA
    context; answers what was set, for the log. Exceeding it is then an
    out-of-memory of this process alone: a co-located engine keeps its memory."""
    import torch

    torch.zeros(1, device=device)  # the context exists from here on
    index = device.index or 0
    used = process_card_mib(index, os.getpid())
    reserved = int(torch.cuda.memory_reserved(device) // MIB)
    context = max(CUDA_CONTEXT_MIB, used - reserved if used is not None else 0)
    total = int(torch.cuda.get_device_properties(device).total_memory)
    fraction = memory_fraction(budget_mib, context, total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return (
        f"card budget {budget_mib} MiB: {context} MiB for the CUDA context, torch may "
        f"allocate {budget_mib - context} MiB ({fraction:.4f} of the card's {total // MIB} MiB)"
    )


def out_of_memory_message(error: str, budget_mib: int | None, estimate_mib: int | None) -> str:
    """The failure of a job that ran out of card memory: how much it asked for,
    its budget and estimate, and what to change."""
    first = error.split(".")[0]
    asked = re.search(r"Tried to allocate ([\d.]+ [KMG]iB)", error)
    what = f"asking for {asked.group(1)} more" if asked else first
    where = (
        f"the trainer ran out of its budget of {budget_mib} MiB (the job's gpu_memory_mib)"
        if budget_mib is not None
        else "the card ran out of memory"
    )
    known = f"; the memory estimate was {estimate_mib} MiB" if estimate_mib is not None else ""
    return (
        f"{where}, {what}{known}; lower batch_size or max_seq_len (raising "
        "gradient_accumulation keeps the batch), turn on gradient_checkpointing, or give "
        "the job more gpu_memory_mib"
    )


# --- the base weights -------------------------------------------------------

HF_PATTERNS = [
    "*.safetensors",
    "*.safetensors.index.json",
    "*.json",
    "*.jinja",
    "*.model",
    "*.txt",
    "*.tiktoken",
    "tokenizer*",
]


def resolve_base(base: Base, offline: bool) -> Path:
    """The directory holding the base's config, tokenizer and safetensors."""
    if base.local_dir is not None:
        d = Path(base.local_dir)
        if not (d / "config.json").is_file():
            raise BadInputError(f"base.local_dir {d} has no config.json")
    else:
        from huggingface_hub import snapshot_download

        if base.hf_repo is None:
            raise BadInputError("the job's base needs exactly one of hf_repo and local_dir")
        try:
            d = Path(
                snapshot_download(
                    repo_id=base.hf_repo,
                    revision=base.hf_revision,
                    allow_patterns=HF_PATTERNS,
                    local_files_only=offline,
                )
            )
        except Exception as e:
            where = "the node's Hugging Face cache" if offline else "the Hugging Face Hub"
            said = f"{base.hf_repo}@{base.hf_revision} is not in {where}: {type(e).__name__}: {e}"
            # Missing from this node's cache is this node's lack (another
            # node may hold it); missing from the Hub, the job's own.
            raise (EnvironmentFailureError if offline else TrainingError)(said) from e
    if not any(d.glob("*.safetensors")):
        raise BadInputError(f"no *.safetensors weights in {d}; only safetensors are read")
    # The trainer runs as the engines' user; weights saved by another user
    # (transformers writes them 0600) would otherwise fail deep inside
    # safetensors with a misleading "No such file or directory".
    unreadable = sorted(p.name for p in d.iterdir() if p.is_file() and not os.access(p, os.R_OK))
    if unreadable:
        raise TrainingError(
            f"the trainer runs as uid {os.getuid()} and cannot read "
            f"{', '.join(unreadable[:5])} in {d}; make the base's files readable by the "
            f"engines' user (chmod -R a+rX {d})"
        )
    return d


def check_target_modules(base_dir: Path, target_modules: list[str] | str) -> None:
    """Refuse module names the base does not have, before its weights load.

    The model is built on torch's meta device from its config (no memory, no
    weights) only to list its modules; peft matches a name against the end of
    each module's dotted path.
    """
    if isinstance(target_modules, str):
        return
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(base_dir), trust_remote_code=False)
    with torch.device("meta"):
        skeleton = cast(Any, AutoModelForCausalLM).from_config(config, trust_remote_code=False)
    names = [n for n, _ in skeleton.named_modules() if n]
    missing = [t for t in target_modules if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        linear = sorted(
            {
                n.rsplit(".", 1)[-1]
                for n, m in skeleton.named_modules()
                if isinstance(m, torch.nn.Linear)
            }
        )
        raise BadInputError(
            f"params.target_modules names {missing}, which this model does not have; "
            f'its linear layers are {linear} (or use "all-linear")'
        )


def _versions() -> dict[str, str]:
    from importlib import metadata

    out = {"python": sys.version.split()[0]}
    for name in ("torch", "transformers", "peft", "accelerate", "safetensors"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "missing"
    return out


def _load_kwargs(dtype: Any) -> dict[str, Any]:
    """from_pretrained's dtype argument: `dtype` since transformers 4.56, `torch_dtype` before."""
    import transformers

    major, minor = (int(x) for x in re.findall(r"\d+", transformers.__version__)[:2])
    key = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    return {key: dtype}


# --- the job ------------------------------------------------------------------


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise TerminatedError()


def plan_total_steps(tokens: Tokens, train: Sequence[int], p: Params) -> int:
    """The job's optimizer steps: max_steps, else epochs of the records with an
    answer token (which tokenizes them all: the count needs every length)."""
    if p.max_steps > 0:
        return p.max_steps
    kept = sum(1 for n in tokens.lengths(train) if n > 0)
    if not kept:
        raise BadInputError(_NO_ANSWER.format(p.max_seq_len))
    per_epoch = math.ceil(math.ceil(kept / p.batch_size) / p.gradient_accumulation)
    return per_epoch * p.epochs


_NO_ANSWER = "no record has an answer token within max_seq_len {}; raise it"


def eval_batches_of(
    tokens: Tokens, held: Sequence[int], p: Params, pad_id: int, device: Any
) -> list[Batch]:
    """The held-out records in length-sorted batches (the loss is a sum per
    token: their order does not change it, and sorting spares the padding)."""
    kept = sorted((e for e in tokens.get(held) if e.answer_tokens), key=lambda e: len(e.input_ids))
    return [
        to_batch(kept[i : i + p.batch_size], pad_id, device)
        for i in range(0, len(kept), p.batch_size)
    ]


def epoch_plan(
    train: Sequence[int],
    p: Params,
    epoch: int,
    lengths_of: Callable[[Sequence[int]], list[int]],
    steps_left: int,
    done: int,
) -> list[list[list[int]]]:
    """`epoch`'s steps, planned with the steps left when it began; BadInputError
    when there are none, or fewer than a resumed run's position says were done."""
    plan = plan_grouped(
        train, p.batch_size, p.gradient_accumulation, p.seed + epoch, lengths_of, steps_left
    )
    if not plan:
        raise BadInputError(_NO_ANSWER.format(p.max_seq_len))
    if done > len(plan):
        raise BadInputError(
            f"the checkpoint's position, step {done} of epoch {epoch}, is past that "
            f"epoch's {len(plan)} steps: the data is not the checkpoint's"
        )
    return plan


@dataclasses.dataclass
class Start:
    """Where training starts: `index` steps into `epoch`'s plan, with the
    progress made by then (a fresh job: epoch 1, index 0)."""

    progress: Progress = dataclasses.field(default_factory=lambda: Progress())
    epoch: int = 1
    index: int = 0


def train_epochs(
    loop: Loop,
    tokens: Tokens,
    split: tuple[list[int], list[int]],
    p: Params,
    total_steps: int,
    pad_id: int,
    start: Start | None = None,
    checkpointer: Checkpointer | None = None,
) -> tuple[Progress, int]:
    """Epochs of length-grouped batches until total_steps, an eval after each
    (and so at the end), a checkpoint when due; answers the progress and the
    epochs run.

    An epoch's plan depends only on the seed, the epoch and the steps left
    when it began (max_steps cuts the last one short): a resumed run rebuilds
    its plan the same way and skips the steps done.
    """
    device = loop.device
    eval_batches: list[Batch] | None = None
    start = start or Start()
    progress, epoch, skip = start.progress, start.epoch - 1, start.index

    def steps_of(plan: list[list[list[int]]], epoch: int) -> Iterator[tuple[int, list[Batch]]]:
        for step in plan:
            yield epoch, [to_batch(tokens.get(mb), pad_id, device) for mb in step]

    while progress.step < total_steps:
        epoch += 1
        epoch_start = progress.step - skip
        plan = epoch_plan(split[0], p, epoch, tokens.lengths, total_steps - epoch_start, skip)

        def on_step(s: dict[str, Any], epoch: int = epoch, epoch_start: int = epoch_start) -> None:
            emit("step", **s)
            if checkpointer is not None:
                checkpointer.after_step(loop, progress, epoch, progress.step - epoch_start)

        train_steps(loop, steps_of(plan[skip:], epoch), total_steps, progress, on_step)
        skip = 0
        if split[1]:
            if eval_batches is None:
                eval_batches = eval_batches_of(tokens, split[1], p, pad_id, device)
            if eval_batches:
                progress.last_eval = eval_loss(loop, eval_batches)
                emit("eval", step=progress.step, epoch=epoch, eval_loss=progress.last_eval)
    return progress, epoch


def preparing_progress(total: int) -> Callable[[int], None]:
    """The progress of tokenizing, as "preparing" state lines (the agent shows them)."""

    def report(done: int) -> None:
        emit("state", state="preparing", message=f"tokenizing: {done} of {total} records")

    return report


def log_cuts(tokens: Tokens, max_seq_len: int) -> None:
    """Warn of the records cut or skipped among those tokenized so far."""
    if tokens.cut:
        log(
            f"{tokens.cut} of {tokens.done} records were longer than max_seq_len {max_seq_len} "
            "tokens and were cut",
            "warning",
        )
    if tokens.skipped:
        log(
            f"{tokens.skipped} records have no answer token within max_seq_len {max_seq_len}; "
            "they are skipped",
            "warning",
        )


#: (gpu_memory_mib, estimate_mib) of the job running, for main's message on an
#: out-of-memory error.
_BUDGET: tuple[int | None, int | None] = (None, None)


def run(job_path: Path) -> int:
    """The whole job; answers the exit status."""
    global _BUDGET
    started = time.time()
    job = parse_job(_read_job(job_path))
    _BUDGET = (job.gpu_memory_mib, job.estimate_mib)
    p = job.params
    records = load_numbered_records(job.data_path, job.data_sha256)
    split = split_records(len(records), p.eval_fraction, p.seed)
    if job.device == "cpu":
        resolve_dtype(p.dtype, "cpu")  # fp16 is refused before anything loads
    versions = _versions()
    log("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    log(f"{len(records)} records: {len(split[0])} to train on, {len(split[1])} held out")

    if job.hf_offline:
        os.environ["HF_HUB_OFFLINE"] = "1"  # read when huggingface_hub is imported
    emit("state", state="preparing", message="loading the tokenizer and the base weights")
    base_dir = resolve_base(job.base, job.hf_offline)
    device, dtype = start_torch(job)
    inputs = prepare_inputs(base_dir, records, split, p)
    total_steps = inputs.total_steps
    check_target_modules(base_dir, p.target_modules)
    # Before the weights load too: a resume that cannot work fails in seconds.
    resume = check_resume(job, total_steps)
    if job.checkpoint_dir is not None:
        open_checkpoint_dir(job.checkpoint_dir)
    loop = load_for_training(job, base_dir, dtype, device, total_steps)
    n_trainable = sum(x.numel() for x in loop.model.parameters() if x.requires_grad)
    log(f"training {n_trainable} LoRA parameters for {total_steps} steps on {device} in {dtype}")
    start, rng = apply_resume(loop, job, resume, total_steps)
    checkpointer = make_checkpointer(job, total_steps)

    done_steps = start.progress.step  # training moves start.progress on
    emit("state", state="running", message=running_message(done_steps, total_steps))
    if rng is not None:  # last: nothing may draw from them before the next step
        restore_rng(rng, device)
    progress, epochs = train_epochs(
        loop, inputs.tokens, inputs.split, p, total_steps, inputs.pad_id, start, checkpointer
    )
    if checkpointer is not None:
        checkpointer.close()

    emit("state", state="saving", message="saving the adapter")
    adapter_dir = job.out_dir / "adapter"
    save_adapter(loop.model, adapter_dir, inputs.template)
    summary = {
        **describe_inputs(job, inputs, base_dir),
        **describe_training(progress, epochs, device, dtype, started),
        "trainable_parameters": n_trainable,
        "versions": versions,
        "resumed_from": describe_resume(job, resume, done_steps),
        "checkpoints": 0 if checkpointer is None else checkpointer.writer.written,
    }
    (adapter_dir / "training_summary.json").write_text(
        json.dumps(summary, indent=2) + "\n", encoding="utf-8"
    )
    emit("done", adapter_dir=str(adapter_dir), base_dir=str(base_dir), summary=summary)
    return 0


def running_message(done_steps: int, total_steps: int) -> str:
    """What the running line says: the steps ahead (a resumed run is past step 1)."""
    if done_steps:
        return f"training steps {done_steps + 1} to {total_steps}"
    return f"training {total_steps} steps"


def describe_resume(
    job: Job, source: tuple[Path, dict[str, Any] | None] | None, done_steps: int
) -> dict[str, Any] | None:
    """The training summary's account of what the run resumed from, if anything."""
    if source is None or job.resume is None:
        return None
    return {"mode": job.resume.mode, "dir": str(source[0]), "step": done_steps}


def start_torch(job: Job) -> tuple[Any, str]:
    """Import torch, check the card the job asks for and keep to its budget,
    seed; the torch device and the dtype name to train in."""
    import torch

    # Progress bars would fill the stderr tail the agent keeps for the reason of a failure.
    with contextlib.suppress(Exception):
        from transformers.utils import logging as hf_logging

        cast(Any, hf_logging).disable_progress_bar()
    if job.device == "cuda" and not torch.cuda.is_available():
        raise EnvironmentFailureError(
            "the job asks for a card but torch sees none (CUDA_VISIBLE_DEVICES?)"
        )
    dtype = resolve_dtype(job.params.dtype, job.device)
    device = torch.device("cuda:0" if job.device == "cuda" else "cpu")
    if device.type == "cuda" and job.gpu_memory_mib is not None:
        log(cap_card_memory(device, job.gpu_memory_mib))
    random.seed(job.params.seed)
    torch.manual_seed(job.params.seed)
    return device, dtype


@dataclasses.dataclass
class Inputs:
    """The records as training reads them, planned before the weights load."""

    records: list[tuple[int, Conversation]]
    split: tuple[list[int], list[int]]
    template: str
    pad_id: int
    tokens: Tokens
    total_steps: int


def prepare_inputs(
    base_dir: Path,
    records: list[tuple[int, Conversation]],
    split: tuple[list[int], list[int]],
    p: Params,
) -> Inputs:
    """The tokenizer, its template and what step 1 needs tokenized (all the
    training records without max_steps, else the first windows of epoch 1):
    before the weights load, so a bad record or too short a max_seq_len fails
    fast and the lengths are known early."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(base_dir), trust_remote_code=False)
    template = chat_template_of(tokenizer)
    if template is PLAIN_TEMPLATE:
        log("the tokenizer has no chat template; records are rendered with the plain one")
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    tokens = Tokens(tokenizer, template, records, p.max_seq_len, preparing_progress(len(records)))
    total_steps = plan_total_steps(tokens, split[0], p)
    if p.max_steps > 0:
        first = plan_grouped(
            split[0], p.batch_size, p.gradient_accumulation, p.seed + 1, tokens.lengths, p.max_steps
        )
        if not first:
            raise BadInputError(_NO_ANSWER.format(p.max_seq_len))
    log_cuts(tokens, p.max_seq_len)
    if tokens.done:  # always, past plan_total_steps and the first plan
        emit(
            "lengths",
            records_tokenized=tokens.done,
            records_cut=tokens.cut,
            records_skipped=tokens.skipped,
            **tokens.length_summary(),
        )
    tokens.on_progress = lambda done: None  # past preparing: no more state lines
    return Inputs(records, split, template, pad_id, tokens, total_steps)


def load_for_training(job: Job, base_dir: Path, dtype: str, device: Any, total_steps: int) -> Loop:
    """The base weights with a fresh LoRA adapter, its optimizer and schedule."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(base_dir),
        use_safetensors=True,
        trust_remote_code=False,
        **_load_kwargs(torch_dtype(dtype)),
        # Straight onto the card: no full copy of the weights in host memory.
        **({"device_map": {"": str(device)}} if device.type == "cuda" else {}),
    )
    model.config.use_cache = False
    loop = prepare_training(model, job.params, dtype, device, total_steps)
    # The adapter (and each checkpoint's) names its base as the catalog does,
    # not by this node's path.
    loop.model.peft_config["default"].base_model_name_or_path = (
        job.base.hf_repo or job.base.local_dir
    )
    return loop


def describe_inputs(job: Job, inputs: Inputs, base_dir: Path) -> dict[str, Any]:
    """The training summary's account of what was trained on."""
    tokens, (train, held_out) = inputs.tokens, inputs.split
    return {
        "job_id": job.job_id,
        "params": dataclasses.asdict(job.params),
        "base": {
            "hf_repo": job.base.hf_repo,
            "hf_revision": job.base.hf_revision if job.base.hf_repo else None,
            "local_dir": job.base.local_dir,
            "base_dir": str(base_dir),
        },
        "data_sha256": job.data_sha256,
        "records": len(inputs.records),
        "records_train": len(train),
        "records_eval": len(held_out),
        "records_cut": tokens.cut,
        "records_skipped": tokens.skipped,
        "records_tokenized": tokens.done,
        "token_lengths": tokens.length_summary(),
        "chat_template": "plain" if inputs.template is PLAIN_TEMPLATE else "tokenizer",
    }


def describe_training(
    progress: Progress, epochs: int, device: Any, dtype: str, started: float
) -> dict[str, Any]:
    """The training summary's account of the run itself."""
    return {
        "final_loss": progress.last_loss,
        "eval_loss": progress.last_eval,
        "steps": progress.step,
        "epochs": epochs,
        "tokens_seen": progress.tokens,
        "padding_tokens": progress.padding,
        "train_time_s": round(progress.train_s, 3),
        "wall_time_s": round(time.time() - started, 3),
        "peak_mib": peak_mib(device),
        "device": str(device),
        "dtype": dtype,
    }


def check_resume(job: Job, total_steps: int) -> tuple[Path, dict[str, Any] | None] | None:
    """The job's resume source (directory, checkpoint.json or None for a peft
    adapter directory), checked: for "continue", against this job's fingerprint."""
    if job.resume is None:
        return None
    d, meta = resume_source(job.resume)
    if job.resume.mode == "continue" and meta is not None:
        diffs = fingerprint_differences(meta.get("fingerprint"), fingerprint_of(job, total_steps))
        if diffs:
            raise BadInputError(
                f"the checkpoint {d} was written for other data or parameters: "
                f"{'; '.join(diffs)}; continue it with the same ones, or start from its "
                'weights (resume.mode "weights")'
            )
        if meta["step"] >= total_steps:
            raise BadInputError(f"the checkpoint {d} is at step {meta['step']}, the job's last")
    return d, meta


def apply_resume(
    loop: Loop, job: Job, source: tuple[Path, dict[str, Any] | None] | None, total_steps: int
) -> tuple[Start, Any]:
    """Load the resume source into `loop`: the adapter weights, and for
    "continue" the rest of the state; answers where training starts and the
    RNG states to restore just before it (None: the job's seed stands)."""
    if source is None or job.resume is None:
        return Start(), None
    d, meta = source
    load_adapter_weights(loop.model, d, loop.device)
    if job.resume.mode == "weights" or meta is None:
        log(f"loaded the adapter weights of {d}; training from step 1")
        return Start(), None
    progress, rng = restore_training_state(loop, d, meta)
    pos = meta["position"]
    log(f"resuming from {d}: step {meta['step']} of {total_steps}, epoch {pos['epoch']}")
    return Start(progress, pos["epoch"], pos["index"]), rng


def make_checkpointer(job: Job, total_steps: int) -> Checkpointer | None:
    """The job's checkpointer; None without a checkpoint_dir or with both
    triggers off."""
    p = job.params
    if job.checkpoint_dir is None or not (p.checkpoint_every_steps or p.checkpoint_every_s):
        return None
    meta = {"job_id": job.job_id, "fingerprint": fingerprint_of(job, total_steps)}
    return Checkpointer(job.checkpoint_dir, p, total_steps, meta)


def save_adapter(model: Any, adapter_dir: Path, template: str) -> None:
    """The trained adapter, as peft writes it, and the chat template it was trained with."""
    try:
        adapter_dir.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(str(adapter_dir), safe_serialization=True)
        (adapter_dir / "chat_template.jinja").write_text(template, encoding="utf-8")
    except OSError as e:
        raise EnvironmentFailureError(
            f"saving the adapter into {adapter_dir} failed: {type(e).__name__}: {e}"
        ) from e


def _read_job(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BadInputError(f"the job file {path} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadInputError(f"the job file {path} is not JSON: {e}") from None


def main(argv: list[str]) -> int:
    _own_stdout()
    # Before anything: the agent's tests read who the trainer runs as.
    emit("log", message=f"uid={os.getuid()} gid={os.getgid()} pid={os.getpid()}", level="info")
    signal.signal(signal.SIGTERM, _on_sigterm)
    # Libraries' deprecation notices among themselves (peft calling a renamed
    # transformers method) are nothing a job's owner can act on.
    warnings.filterwarnings("ignore", category=FutureWarning)
    if len(argv) != 2:
        emit("error", message="usage: script.py job.json")
        return 2
    try:
        return run(Path(argv[1]))
    except BadInputError as e:
        emit("error", message=str(e))
        return 2
    except TrainingError as e:
        emit("error", message=str(e))
        return 1
    except EnvironmentFailureError as e:
        emit("error", message=str(e))
        return 3
    except TerminatedError:
        emit("error", message="stopped by SIGTERM")
        return 143
    except Exception as e:
        import traceback

        traceback.print_exc(file=sys.stderr)
        with contextlib.suppress(Exception):
            emit("error", message=failure_message(e))
        return 3 if is_environment_failure(e) else 1


#: A CUDA or driver error in an exception's text: the node's card failed the
#: job (an ECC error, a card fallen off the bus, a driver gone), not the job.
_ENVIRONMENT_ERROR = re.compile(
    r"CUDA error|CUDA driver|cuDNN error|CUBLAS_STATUS|CUSOLVER_STATUS|NCCL error|"
    r"\bECC\b|no CUDA-capable device|CUDA-capable device\(s\) is/are busy"
)


def is_environment_failure(e: BaseException) -> bool:
    """Whether an unexpected exception is the node's failure, not the job's
    (exit 3): a CUDA or driver error, but not an out of memory (the job's
    budget) nor a device-side assert (an index out of range: the job's data)."""
    text = str(e)
    if type(e).__name__ == "OutOfMemoryError" or "out of memory" in text:
        return False
    if "device-side assert" in text:
        return False
    return type(e).__name__ == "AcceleratorError" or bool(_ENVIRONMENT_ERROR.search(text))


def failure_message(e: Exception) -> str:
    """The "error" line of an unexpected exception: its type and text, or for
    torch's out-of-memory error the budget, the estimate and what to change."""
    if type(e).__name__ == "OutOfMemoryError":  # torch's, for a card
        return out_of_memory_message(str(e), *_BUDGET)
    return f"{type(e).__name__}: {e}"


if __name__ == "__main__":
    sys.exit(main(sys.argv))
