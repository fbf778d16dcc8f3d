"""The JSON Schemas in schemas/json are generated from the Structs, and match them."""

from __future__ import annotations

import importlib
import json
import pkgutil
from pathlib import Path

import msgspec
import pytest

from lorafleet_schemas import generate
from lorafleet_schemas.messages import (
    PUBLISHED,
    JobSpec,
    NodeCancelRequest,
    StartRequest,
    TrainerLine,
    TrainerParams,
)
from tests.agent.conftest import start_request


def test_checked_in_schemas_match_the_structs() -> None:
    assert generate.stale() == [], "run: python -m lorafleet_schemas.generate"


def test_a_changed_struct_makes_the_files_stale(tmp_path: Path) -> None:
    generate.write(tmp_path)
    assert generate.stale(tmp_path) == []
    victim = tmp_path / "job-spec.schema.json"
    schema = json.loads(victim.read_text())
    schema["title"] = "edited by hand"
    victim.write_text(json.dumps(schema))
    (tmp_path / "left-over.schema.json").write_text("{}")
    assert generate.stale(tmp_path) == ["job-spec.schema.json", "left-over.schema.json"]


def test_every_published_message_has_a_file() -> None:
    names = {p.name for p in generate.JSON_DIR.glob("*.schema.json")}
    assert names == {f"{n}.schema.json" for n in PUBLISHED}


def test_job_spec_schema_states_the_limits() -> None:
    schema = json.loads((generate.JSON_DIR / "job-spec.schema.json").read_text())
    params = schema["$defs"]["TrainerParams"]["properties"]
    assert params["rank"]["minimum"] == 1
    assert params["learning_rate"]["exclusiveMinimum"] == 0
    assert schema["$defs"]["JobSpec"]["additionalProperties"] is False


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b'{"model": "m", "gpu_memory_mib": 0}', "$.gpu_memory_mib"),
        (b'{"model": "m", "gpu_memory_mib": 1, "params": {"rank": 0}}', "$.params.rank"),
        (b'{"model": "m", "gpu_memory_mib": 1, "colour": "red"}', "colour"),
        (b'{"model": "a.b", "gpu_memory_mib": 1}', "$.model"),
    ],
)
def test_bad_job_specs_name_the_field(body: bytes, field: str) -> None:
    with pytest.raises(msgspec.ValidationError, match=field.replace("$", r"\$")):
        msgspec.json.decode(body, type=JobSpec)


def test_trainer_lines_decode_by_their_event_tag() -> None:
    line = b'{"event": "step", "step": 1, "steps": 2, "loss": 1.5, "learning_rate": 0.1,'
    line += b' "tokens_per_s": 10.0, "eta_s": 1.0, "peak_mib": 5}'
    step = msgspec.json.decode(line, type=TrainerLine)
    assert type(step).__name__ == "TrainerStep"
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"event": "nonsense"}', type=TrainerLine)


def test_new_fields_have_defaults() -> None:
    # An old sender that knows only the required fields stays valid.
    assert msgspec.json.decode(b"{}", type=TrainerParams) == TrainerParams()


def test_every_domain_module_is_re_exported() -> None:
    """Clients import from `lorafleet_schemas.messages`; a Struct added to a
    domain module and not to the package would be reachable only by its path."""
    package = importlib.import_module("lorafleet_schemas.messages")
    missing = [
        f"{info.name}.{name}"
        for info in pkgutil.iter_modules(package.__path__, "lorafleet_schemas.messages.")
        for name, value in vars(importlib.import_module(info.name)).items()
        if getattr(value, "__module__", None) == info.name and name not in package.__all__
    ]
    assert not missing, "add to lorafleet_schemas/messages/__init__.py:\n" + "\n".join(missing)


def test_a_start_request_at_its_defaults_is_read_by_an_agent_without_newer_fields() -> None:
    """A node request leaves out what is at its default: an agent that does
    not know a field yet reads a start of a job that does not use it."""

    class OlderCancel(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
        job_id: str

    sent = msgspec.json.encode(NodeCancelRequest(job_id="j1"))
    assert msgspec.json.decode(sent, type=OlderCancel).job_id == "j1"
    start = start_request("j1", "datasets/x", "a" * 64)
    fields = msgspec.json.decode(msgspec.json.encode(start), type=dict)
    for name in ("eval_dataset", "eval_dataset_sha256", "serve", "resume"):
        assert name not in fields, sorted(fields)
    assert msgspec.json.decode(msgspec.json.encode(start), type=StartRequest) == start
