"""Rules about serving that the agent, the scheduler, the gateway and
retention share, written once: the name an adapter version is served under,
whether an engine in a heartbeat serves a catalog base, and a job's serving
policy."""

from __future__ import annotations

import re

from lorafleet_schemas.messages import EngineRef, JobRecord, ModelRecord, ServingPolicy


def served_adapter_name(job_id: str, sha256: str) -> str:
    """`<job id>-<first 12 of the adapter's sha256>`: one name per adapter version."""
    return f"{job_id}-{sha256[:12]}"


#: A served adapter name of a recorder's job (its ids: 16 hex digits).
_SERVED_NAME = re.compile(r"(?P<job>[0-9a-f]{16})-[0-9a-f]{12}")


def served_name_job(name: str) -> str | None:
    """The job whose adapter `name` is the served name of, or None."""
    m = _SERVED_NAME.fullmatch(name)
    return None if m is None else m["job"]


def serves_base(engine: EngineRef, model: ModelRecord) -> bool:
    """Whether `engine`'s base model is the catalog's `model` (by its name,
    its local directory or its hub id)."""
    names = {model.name, model.local_dir, model.hf_repo} - {None}
    return engine.model is not None and engine.model.rstrip("/") in {
        n.rstrip("/") for n in names if n
    }


def policy_of(job: JobRecord, model: ModelRecord | None) -> ServingPolicy | None:
    """The job's policy, else its model's default; None when neither (or
    `serve: false`): then only the node that trained it serves it."""
    if job.serve is False:
        return None
    if job.serving is not None:
        return job.serving
    return model.serving if model is not None else None
