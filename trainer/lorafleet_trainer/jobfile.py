"""The job file: what the agent writes into the job directory as job.json and
the trainer (and its stand-in) reads.

One JSON object: the fields of `JobFile`, each required unless it has a
default there (`Base` and `Resume` are its nested objects), with paths as
strings and `params` the TrainerParams fields (lorafleet_trainer.params).
`JobFile.parse` refuses anything else with a BadInputError naming the key;
`to_json` writes what `parse` reads.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

from lorafleet_trainer.params import PARAM_RULES, Params
from lorafleet_trainer.protocol import BadInputError

#: A sha256 as lorafleet writes it: 64 lowercase hex digits (the message
#: schemas' Sha256Hex is this pattern too).
SHA256_HEX_PATTERN = r"^[0-9a-f]{64}$"

RESUME_MODES = ("continue", "weights")
DEVICES = ("cuda", "cpu")


@dataclasses.dataclass(frozen=True)
class Base:
    """Exactly one of hf_repo and local_dir."""

    #: Read from the Hugging Face cache (HF_HOME, set by the agent) with
    #: huggingface_hub.snapshot_download.
    hf_repo: str | None
    #: Default "main".
    hf_revision: str
    #: A directory holding config.json, tokenizer files and *.safetensors.
    local_dir: str | None

    @property
    def model(self) -> str:
        """The base as the catalog names it: repo@revision, or the directory."""
        return f"{self.hf_repo}@{self.hf_revision}" if self.hf_repo else str(self.local_dir)


@dataclasses.dataclass(frozen=True)
class Resume:
    #: A checkpoint directory, a directory of them (the newest complete one is
    #: used) or, for "weights", a peft adapter directory.
    dir: Path
    #: "continue": this job's own checkpoint; checkpoint.json and its
    #: fingerprint are checked (bad input naming what differs), the adapter,
    #: optimizer, LR scheduler, GradScaler and RNG states and the data-plan
    #: position restored, and training goes on with the step after it: the same
    #: losses and, on the CPU, the same adapter as a run never interrupted.
    #: "weights": only the adapter weights are loaded (same rank and target
    #: modules, else bad input) and the job trains from step 1.
    mode: str


@dataclasses.dataclass(frozen=True)
class JobFile:
    job_id: str
    base: Base
    #: The records (lorafleet_trainer.records).
    data_path: Path
    #: Lowercase hex sha256 of the data file; a mismatch is refused.
    data_sha256: str
    #: The adapter goes to <out_dir>/adapter (lorafleet_trainer.layout).
    out_dir: Path
    #: The TrainerParams fields, each optional with the same defaults and bounds;
    #: unknown keys are refused. max_steps > 0 wins over epochs; dtype "auto" is
    #: bf16 on cards with bf16, fp16 on other cards, fp32 on the CPU.
    params: Params = dataclasses.field(default_factory=Params)
    #: "cuda" (the first visible card) or "cpu".
    device: str = "cuda"
    #: Read the Hugging Face cache only.
    hf_offline: bool = True
    #: The card memory the whole process may use (CUDA context included): torch's
    #: allocator is capped at it less the context, so going over is an
    #: out-of-memory of this process alone. params.gradient_checkpointing "auto"
    #: chooses by it on either device (lorafleet_trainer.memory). None: no cap.
    gpu_memory_mib: int | None = None
    #: The job's memory estimate, for the message when the budget is exceeded.
    estimate_mib: int | None = None
    #: Where checkpoints go (each a step-NNNNNNNN directory; created if missing,
    #: .tmp-* leftovers of crashed writes cleared); None: none are written.
    checkpoint_dir: Path | None = None
    #: Where the job starts from, when not from scratch.
    resume: Resume | None = None
    #: The evaluation set and its sha256, both or neither, checked as the data
    #: is; with one every record of the data is trained on. None:
    #: params.eval_fraction of the data is held out.
    eval_data_path: Path | None = None
    eval_data_sha256: str | None = None
    #: The pause file the agent writes while the node's engines are busy
    #: (lorafleet_trainer.protocol.PauseGate); None: the trainer never yields.
    pause_path: Path | None = None
    #: The file the agent writes to ask for a checkpoint after the next step
    #: (protocol.CheckpointAsks); None: checkpoints on the schedule only.
    checkpoint_now_path: Path | None = None

    def to_json(self) -> str:
        """The job file's text (parse's input)."""
        raw = dataclasses.asdict(self)
        for key in (
            "data_path",
            "out_dir",
            "checkpoint_dir",
            "eval_data_path",
            "pause_path",
            "checkpoint_now_path",
        ):
            raw[key] = None if raw[key] is None else str(raw[key])
        if self.resume is not None:
            raw["resume"] = {"dir": str(self.resume.dir), "mode": self.resume.mode}
        return json.dumps(raw, indent=2)

    @classmethod
    def read(cls, path: Path) -> JobFile:
        """The job file at `path`, checked."""
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise BadInputError(f"the job file {path} does not exist") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadInputError(f"the job file {path} is not JSON: {e}") from None
        return cls.parse(raw)

    @classmethod
    def parse(cls, raw: Any) -> JobFile:
        """The job file's decoded JSON, checked against `JobFile`'s fields."""
        if not isinstance(raw, dict):
            raise BadInputError("the job file must hold a JSON object")
        base = parse_base(raw.get("base"))
        sha = _sha256(raw, "data_sha256")
        eval_path = _str(raw, "eval_data_path", optional=True)
        eval_sha = None if raw.get("eval_data_sha256") is None else _sha256(raw, "eval_data_sha256")
        if (eval_path is None) != (eval_sha is None):
            raise BadInputError(
                "the job's eval_data_path and eval_data_sha256 go together: give both or neither"
            )
        device = raw.get("device", "cuda")
        if device not in DEVICES:
            raise BadInputError(f'the job\'s device is {device!r}; it must be "cuda" or "cpu"')
        offline = raw.get("hf_offline", True)
        if not isinstance(offline, bool):
            raise BadInputError(f"the job's hf_offline is {offline!r}; it must be true or false")
        mibs = {k: raw.get(k) for k in ("gpu_memory_mib", "estimate_mib")}
        for key, v in mibs.items():
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise BadInputError(
                    f"the job's {key} is {v!r}; it must be a positive integer or null"
                )
        return cls(
            job_id=str(raw.get("job_id", "")),
            base=base,
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
            eval_data_path=_path(eval_path),
            eval_data_sha256=eval_sha,
            pause_path=_path(_str(raw, "pause_path", optional=True)),
            checkpoint_now_path=_path(_str(raw, "checkpoint_now_path", optional=True)),
        )


def _sha256(raw: dict[str, Any], key: str) -> str:
    sha = _str(raw, key) or ""
    if not re.fullmatch(SHA256_HEX_PATTERN, sha):
        raise BadInputError(f"the job's {key} is {sha!r}; it must be 64 lowercase hex digits")
    return sha


def parse_base(raw: Any) -> Base:
    """The job file's base object."""
    if not isinstance(raw, dict):
        raise BadInputError("the job's base is missing; it must be an object")
    hf_repo = _str(raw, "hf_repo", optional=True)
    local_dir = _str(raw, "local_dir", optional=True)
    if (hf_repo is None) == (local_dir is None):
        raise BadInputError("the job's base needs exactly one of hf_repo and local_dir")
    revision = raw.get("hf_revision") or "main"
    if not isinstance(revision, str):
        raise BadInputError(f"the job's base.hf_revision is {revision!r}; it must be a string")
    return Base(hf_repo=hf_repo, hf_revision=revision, local_dir=local_dir)


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


def _path(v: str | None) -> Path | None:
    return None if v is None else Path(v)


def _str(raw: dict[str, Any], key: str, *, optional: bool = False) -> str | None:
    v = raw.get(key)
    if v is None and optional:
        return None
    if not isinstance(v, str) or not v:
        raise BadInputError(f"the job's {key} is {v!r}; it must be a non-empty string")
    return v


# --- the parameters, by PARAM_RULES -----------------------------------------------


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
    if kind == "switch" and v == bounds["word"]:
        return v
    if kind == "switch" and not isinstance(v, bool):
        raise BadInputError(f'params.{name} is {v!r}; it must be true, false or "{bounds["word"]}"')
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
