"""The model catalog: what a model is, where its weights are, what serves it."""

from __future__ import annotations

import datetime as dt
import enum
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from lorafleet_schemas.messages.fields import SubjectToken


class Engine(enum.StrEnum):
    """The engine that serves a catalog model on the nodes."""

    VLLM = "vllm"
    LLAMACPP = "llamacpp"


class ModelArchitecture(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What a memory estimate needs of a decoder model, from its config.json.

    `lorafleet models add` reads it from a local directory or the Hugging Face
    cache (`lorafleet.estimate.architecture_from_config`); the API takes it as
    given. Sizes are counts, not bytes.
    """

    num_hidden_layers: Annotated[int, Meta(ge=1)]
    hidden_size: Annotated[int, Meta(ge=1)]
    intermediate_size: Annotated[int, Meta(ge=1)]
    num_attention_heads: Annotated[int, Meta(ge=1)]
    num_key_value_heads: Annotated[int, Meta(ge=1)]
    vocab_size: Annotated[int, Meta(ge=1)]
    #: hidden_size / num_attention_heads unless the config says otherwise.
    head_dim: Annotated[int, Meta(ge=1)] | None = None
    #: The weights' parameter count; computed from the shapes when not given.
    parameters: Annotated[int, Meta(ge=1)] | None = None
    #: The dtype the weights are stored in (config.json's torch_dtype / dtype).
    weight_dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    tie_word_embeddings: bool = False
    #: q, k and v projections carry a bias (Qwen2 does).
    attention_bias: bool = False


class Replicas(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A serving policy of N replicas: the adapter on `replicas` nodes chosen
    by rendezvous hashing over the live nodes with a free adapter slot in an
    engine serving its base, so a placement stays put while other nodes come
    and go."""

    replicas: Annotated[int, Meta(ge=1, le=1000)]


#: Where a finished adapter is served across the fleet: "all" (every live
#: node whose heartbeat lists an engine serving the base), or
#: `{"replicas": N}`. The control plane places it and keeps it placed
#: (docs/fine-tune-and-serve.md, "Placement"); None: only the node that trained it
#: (JobSpec.serve).
ServingPolicy = Literal["all"] | Replicas


class ModelSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A catalog entry: where a model's safetensors weights are, and what serves it.

    Exactly one of `hf_repo` and `local_dir` is set.
    """

    name: SubjectToken
    engine: Engine
    hf_repo: str | None = None
    #: A branch, tag or commit of `hf_repo`; default "main".
    hf_revision: str = "main"
    #: A directory holding the weights on every node that trains this model.
    local_dir: str | None = None
    description: str = ""
    #: From the model's config.json; without it jobs get no memory estimate.
    architecture: ModelArchitecture | None = None
    #: The serving policy of this model's jobs that name none (JobSpec.serving).
    serving: ServingPolicy | None = None


class ModelRecord(msgspec.Struct, kw_only=True):
    name: str
    engine: Engine
    hf_repo: str | None
    hf_revision: str
    local_dir: str | None
    description: str
    created_at: dt.datetime
    architecture: ModelArchitecture | None = None
    #: See ModelSpec.serving.
    serving: ServingPolicy | None = None


class ModelListRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class ModelList(msgspec.Struct, kw_only=True):
    models: list[ModelRecord]
