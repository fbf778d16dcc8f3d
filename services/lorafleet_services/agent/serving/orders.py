"""What the serving agent is asked to serve, and the plain steps around a
load: which engines match a model, the adapter fetched from the store,
the GGUF put where llama-server reads it.

A `ServeOrder` comes from a finished job (auto-serve: the adapter staged
from the job directory before it goes) or from `node.<node>.serve` (the
adapter fetched from the artifacts object store by name, its sha256
checked, unpacked by the same code a resumed job uses).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from nats.js import JetStreamContext

from lorafleet.artifacts import file_sha256
from lorafleet.fleet_serving import served_adapter_name
from lorafleet_schemas.messages import ArtifactKind, Engine, ModelRecord, StartRequest
from lorafleet_services.agent.config import AgentConfig
from lorafleet_services.agent.serving.running_engines import VllmServer
from lorafleet_services.agent.serving.vllm_adapters import (
    serves_model,
    stage_adapter,
)
from lorafleet_services.agent.transfer.fetch import fetch_checked
from lorafleet_services.agent.transfer.packing import pack_adapter, unpack

#: ServingReport.engine when no engine on the node serves the model.
NO_ENGINE = ""


@dataclass(frozen=True, slots=True)
class ServeOrder:
    """One adapter version to serve on this node.

    sha256: the PEFT artifact's (the tar.gz the store holds; for llama.cpp
    the GGUF's): it names the version. adapter_dir: the staged PEFT copy
    (`<served>/<name>/`), None until fetched. gguf: the GGUF file, for a
    llama.cpp model. probe_base: the base the PEFT probe loads (a directory,
    or a hub id). serve: JobSpec.serve. engine: only this one (its url).
    """

    job_id: str
    model: ModelRecord
    sha256: str
    probe_base: str
    serve: bool | None = None
    adapter_dir: Path | None = None
    gguf: Path | None = None
    engine: str | None = None
    #: The artifacts bucket's object to fetch when the adapter is not held.
    object: str | None = None
    #: NodeServeRequest.placed: never evicted here.
    placed: bool = False

    @property
    def served_name(self) -> str:
        return served_adapter_name(self.job_id, self.sha256)


class AdapterFetchError(Exception):
    """The adapter could not be fetched from the store; the message says why."""


def model_base(model: ModelRecord) -> str:
    """What an engine serving `model` was started with (--model)."""
    return model.local_dir or model.hf_repo or model.name


def matching_engines(
    servers: list[VllmServer], model: ModelRecord, engine: str | None = None
) -> list[VllmServer]:
    """The vLLM servers that serve `model` (as the preflight matches it), or
    only the one whose url is `engine`."""
    base = model_base(model)
    return [s for s in servers if serves_model(s, base) and engine in (None, s.url)]


def read_model_type(base: str) -> str | None:
    """config.json's model_type of a base directory; None for a hub id or no config."""
    with contextlib.suppress(OSError, ValueError):
        value = json.loads((Path(base) / "config.json").read_text()).get("model_type")
        return str(value) if value else None
    return None


def order_from_job(
    req: StartRequest,
    cfg: AgentConfig,
    adapter_dir: Path,
    base_dir: Path,
    shas: Mapping[ArtifactKind, str],
    files: Mapping[ArtifactKind, Path],
    job_dir: Path,
) -> ServeOrder:
    """A delivered job's ServeOrder, its adapter copied out of the job
    directory (which goes next): the PEFT adapter staged as
    `<served>/<name>/`, or for a llama.cpp model the GGUF kept beside it.
    A job that delivered no PEFT artifact is packed here for its sha256 (the
    version's name)."""

    def peft_sha() -> str:
        if ArtifactKind.PEFT in shas:
            return shas[ArtifactKind.PEFT]
        return file_sha256(pack_adapter(adapter_dir, job_dir / "adapter.tar.gz"))

    if req.model.engine is Engine.LLAMACPP:
        gguf, sha = None, shas.get(ArtifactKind.GGUF)
        if sha is not None and ArtifactKind.GGUF in files:
            cfg.served_dir.mkdir(parents=True, exist_ok=True)
            gguf = cfg.served_dir / f".{served_adapter_name(req.job_id, sha)}.gguf"
            shutil.copyfile(files[ArtifactKind.GGUF], gguf)
        # No GGUF: the serving agent refuses it, naming the fix.
        return ServeOrder(job_id=req.job_id, model=req.model, sha256=sha or peft_sha(),
                          probe_base=str(base_dir), serve=req.serve, gguf=gguf)  # fmt: skip
    sha = peft_sha()
    staged = stage_adapter(adapter_dir, cfg.work_dir, served_adapter_name(req.job_id, sha))
    return ServeOrder(job_id=req.job_id, model=req.model, sha256=sha, probe_base=str(base_dir),
                      serve=req.serve, adapter_dir=staged)  # fmt: skip


async def fetch_adapter(
    js: JetStreamContext, bucket: str, obj: str, sha256: str, served_dir: Path, name: str
) -> Path:
    """The PEFT artifact `obj` fetched, checked against `sha256` and unpacked
    into `<served_dir>/<name>/` (made whole before it appears)."""
    served_dir.mkdir(parents=True, exist_ok=True)
    archive = served_dir / f".{name}.tar.gz"
    unpacked = served_dir / f".{name}.fetched"
    try:
        await fetch_checked(
            js, bucket, obj, sha256, archive, "adapter", AdapterFetchError,
            gone="it was removed; train the job again",
            damaged=f"not {sha256} as asked: it was replaced or damaged",
        )  # fmt: skip
        try:
            await asyncio.to_thread(unpack, archive, unpacked)
        except (tarfile.TarError, OSError) as e:
            raise AdapterFetchError(f"unpacking the adapter {obj!r}: {e}") from None
        return await asyncio.to_thread(stage_adapter, unpacked, served_dir.parent, name)
    finally:
        archive.unlink(missing_ok=True)
        await asyncio.to_thread(shutil.rmtree, unpacked, True)


async def fetch_gguf(
    js: JetStreamContext, bucket: str, obj: str, sha256: str, target: Path
) -> Path:
    """The GGUF artifact `obj` fetched into `target` (checked, then renamed into place)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    part = target.with_name(f".{target.name}.part")
    try:
        await fetch_checked(
            js, bucket, obj, sha256, part, "GGUF", AdapterFetchError,
            gone="it was removed; train the job again", damaged=f"not {sha256} as asked",
        )  # fmt: skip
    except AdapterFetchError:
        part.unlink(missing_ok=True)
        raise
    part.chmod(0o644)
    part.rename(target)
    return target


def place_gguf(gguf: Path, adapters_dir: Path, name: str) -> Path:
    """The GGUF copied to `<adapters_dir>/<name>.gguf`, readable by every user,
    whole before it appears."""
    adapters_dir.mkdir(parents=True, exist_ok=True)
    adapters_dir.chmod(adapters_dir.stat().st_mode | 0o755)
    target = adapters_dir / f"{name}.gguf"
    part = adapters_dir / f".{name}.gguf.part"
    shutil.copyfile(gguf, part)
    part.chmod(0o644)
    part.rename(target)
    return target


def lora_flag(path: Path) -> str:
    """What llama-server needs to take the adapter at its next start."""
    return f"--lora {path}"


def no_engine_reason(node: str, order: ServeOrder) -> str:
    """Why `order` is served nowhere on `node`, and what would serve it."""
    which = f" at {order.engine}" if order.engine else ""
    base = model_base(order.model)
    return (
        f"no vLLM{which} on {node} serves {base!r} (model {order.model.name}): "
        f"start one with --model {base} --enable-lora"
    )
