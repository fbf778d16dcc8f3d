"""Serving what was trained: a finished adapter loaded into an engine running
on a node, recorded beside its job.

One serving record per (job, node, engine). The agent loads, confirms and
unloads (`lorafleet.node.<node>.serve` / `.unserve`, and on its own after a
job's `done` when the job asks to be served); it reports each change as a
`ServingReport` on the status stream; the recorder keeps the record and
publishes a `JobEvent` with kind "serving" on the job's subject. Clients ask
through `lorafleet.api.adapters.serve` / `.unserve` / `.list`.
"""

from __future__ import annotations

import datetime as dt
import enum
from typing import Annotated

import msgspec
from msgspec import Meta

from lorafleet_schemas.messages.catalog import Engine, ModelRecord
from lorafleet_schemas.messages.fields import ListLimit, Sha256Hex, SubjectToken


class ServingState(enum.StrEnum):
    """Where one adapter stands on one engine.

    loading: asked for, the agent is loading it (or will, when the engine
    comes back). served: loaded and confirmed. refused: the preflight said
    no (`reason` names the limit, `lift` the flag that would lift it).
    failed: the engine refused the load or answered the probe unlike PEFT.
    restart_required: a llama.cpp engine, which takes adapters only at its
    start: the GGUF is in place, `lift` is the flag to add. unloaded: taken
    out (unserve, or evicted for a newer one: `reason` says which).
    """

    LOADING = "loading"
    SERVED = "served"
    REFUSED = "refused"
    FAILED = "failed"
    RESTART_REQUIRED = "restart_required"
    UNLOADED = "unloaded"


class EngineRef(msgspec.Struct, kw_only=True):
    """One engine running on a node, as the agent sees it (the heartbeat
    carries these). `url` is the engine's key on its node."""

    kind: Engine
    url: str
    #: The name requests use for the base model (vLLM: the first
    #: `--served-model-name`, else `--model`); None when unknown.
    model: str | None = None
    #: LoRA limits read from its command line; None: unknown.
    enable_lora: bool | None = None
    runtime_updating: bool | None = None
    max_lora_rank: int | None = None
    max_loras: int | None = None
    max_cpu_loras: int | None = None
    #: The adapters it has loaded now (their served names).
    adapters: list[str] = msgspec.field(default_factory=list)
    #: False when its last /v1/models read went unanswered (starting, hung,
    #: overloaded): `adapters` is then what the same process listed last
    #: (none for a process never read).
    answered: bool = True


class ServingRecord(msgspec.Struct, kw_only=True):
    """One adapter on one engine, as the recorder holds it."""

    job_id: str
    node: str
    #: The engine's url on its node (EngineRef.url).
    engine: str
    engine_kind: Engine
    #: The catalog model the adapter was trained on.
    model: str
    #: The name requests use for the adapter on the engine (vLLM's
    #: lora_name): `<job>-<first 12 of its sha256>`, unique to this version.
    served_name: str
    #: The adapter artifact's sha256 (which version is served).
    sha256: str
    state: ServingState
    #: Why it is in this state (a refusal's numbers, a failure's message).
    reason: str = ""
    #: For refused and restart_required: the engine flag (or training
    #: change) that would let it load.
    lift: str = ""
    #: The largest |engine - PEFT| log-probability on the probe, once served.
    probe_error: float | None = None
    created_at: dt.datetime
    updated_at: dt.datetime
    #: Grows by one with every committed change (as JobRecord.version).
    version: int = 0


class ServingReport(msgspec.Struct, kw_only=True):
    """Published by the agent on `lorafleet.status.<node>.<job>.serving`
    (the status stream): one serving change; the recorder upserts the record
    for (job_id, node, engine). `seq` grows per node across its reports, so
    the recorder ignores a report older than the one it holds."""

    job_id: str
    node: str
    engine: str
    engine_kind: Engine
    model: str
    served_name: str
    sha256: Sha256Hex
    state: ServingState
    seq: Annotated[int, Meta(ge=1)]
    time: dt.datetime
    reason: str = ""
    lift: str = ""
    probe_error: float | None = None


class AdapterServeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`lorafleet.api.adapters.serve`: load a done job's adapter on a node's
    engines that serve its model."""

    job_id: str
    #: The node whose engines should serve it; None: the node it trained on.
    node: SubjectToken | None = None
    #: One engine (its url) on that node; None: every matching engine.
    engine: str | None = None


class AdapterUnserveRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`lorafleet.api.adapters.unserve`: take it out (of one node; None: of every node)."""

    job_id: str
    node: SubjectToken | None = None
    engine: str | None = None


class AdapterListRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`lorafleet.api.adapters.list`: serving records, newest change first."""

    job_id: str | None = None
    #: Several jobs at once (combined with job_id when both are given).
    job_ids: list[str] = msgspec.field(default_factory=list)
    node: str | None = None
    model: str | None = None
    state: ServingState | None = None
    limit: ListLimit = 200
    #: The records past this one (the last of the page before) in key order
    #: (job, node, engine): every record, page by page, none twice while
    #: they change; the empty key (all three "") is before every record.
    #: Without it: the newest change first.
    after: AdapterKey | None = None


class AdapterKey(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A serving record's key: one adapter on one engine."""

    job_id: str
    node: str
    engine: str


class AdapterList(msgspec.Struct, kw_only=True):
    adapters: list[ServingRecord]


class NodeServeRequest(
    msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True
):
    """`lorafleet.node.<node>.serve`: load this adapter version into the
    node's engines that serve `model` (or the one named). Strict, defaults
    left out: as StartRequest."""

    job_id: str
    model: ModelRecord
    #: The PEFT adapter in `lorafleet_artifacts` (the agent fetches it
    #: when it does not hold it) and its sha256.
    object: str
    sha256: Sha256Hex
    engine: str | None = None
    #: Sent by the control plane's placement (a job's serving policy): the
    #: agent never evicts it to make room (it may be the last replica).
    placed: bool = False


class NodeUnserveRequest(
    msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True
):
    """`lorafleet.node.<node>.unserve`."""

    job_id: str
    engine: str | None = None


class NodeServeReply(msgspec.Struct, kw_only=True):
    """What the agent took on; each engine's outcome follows as ServingReports.
    `api.adapters.serve` answers with it too, `node` filled in."""

    #: The engines it will load into (or unload from), by url.
    engines: list[str] = msgspec.field(default_factory=list)
    #: Why none, when none (no engine on the node serves the model, ...).
    reason: str = ""
    #: The node that answered (the scheduler sets it; an agent may leave it empty).
    node: str = ""


class AdapterUnserveReply(msgspec.Struct, kw_only=True):
    """`lorafleet.api.adapters.unserve`'s answer: each node asked, as it answered."""

    replies: list[NodeServeReply] = msgspec.field(default_factory=list)
