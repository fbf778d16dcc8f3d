"""The trainer's parameters (lorafleet_trainer/params.py) are generated from
TrainerParams and kept fresh."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import msgspec
import pytest

from lorafleet_schemas.messages import TrainerParams
from lorafleet_services.paramgen import generate
from lorafleet_trainer.jobfile import parse_params
from lorafleet_trainer.params import Params
from lorafleet_trainer.protocol import BadInputError


def test_the_trainers_parameters_module_is_fresh() -> None:
    assert not generate.is_stale(), (
        f"{generate.MODULE} differs from TrainerParams: "
        "run python -m lorafleet_services.paramgen.generate"
    )


def test_a_hand_edited_module_is_stale(tmp_path: Path) -> None:
    module = tmp_path / "params.py"
    text = generate.MODULE.read_text()
    module.write_text(text.replace('"rank": ("int", {"ge": 1, "le": 1024})', '"rank": ("int", {})'))
    assert generate.is_stale(module)
    assert generate.is_stale(tmp_path / "missing.py")


def test_the_trainers_defaults_are_the_structs() -> None:
    assert dataclasses.asdict(Params()) == msgspec.to_builtins(TrainerParams())


@pytest.mark.parametrize(
    ("field", "value"),
    [("rank", 1024), ("rank", 1), ("dropout", 0.0), ("learning_rate", 1), ("max_seq_len", 8)],
)
def test_what_the_struct_accepts_at_its_bounds_the_trainer_accepts(
    field: str, value: object
) -> None:
    msgspec.convert({field: value}, TrainerParams)
    assert getattr(parse_params({field: value}), field) == value


@pytest.mark.parametrize(
    ("field", "value"),
    [("rank", 1025), ("rank", 0), ("dropout", 1.0), ("learning_rate", 0), ("max_seq_len", 7)],
)
def test_what_the_struct_refuses_at_its_bounds_the_trainer_refuses(
    field: str, value: object
) -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({field: value}, TrainerParams)
    with pytest.raises(BadInputError, match=f"params.{field}"):
        parse_params({field: value})
