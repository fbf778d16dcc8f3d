"""The script's parameter table is generated from TrainerParams and kept fresh."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import ModuleType

import msgspec
import pytest

from lorafleet_schemas.messages import TrainerParams
from lorafleet_services.trainer import generate


def test_the_scripts_parameter_table_is_fresh() -> None:
    assert not generate.is_stale(), (
        "services/lorafleet_services/trainer/script.py's parameter table differs from "
        "TrainerParams: run python -m lorafleet_services.trainer.generate"
    )


def test_a_hand_edited_table_is_stale(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    text = generate.SCRIPT.read_text()
    script.write_text(text.replace('"rank": ("int", {"ge": 1, "le": 1024})', '"rank": ("int", {})'))
    assert generate.is_stale(script)


def test_the_scripts_defaults_are_the_structs(trainer_module: ModuleType) -> None:
    assert dataclasses.asdict(trainer_module.Params()) == msgspec.to_builtins(TrainerParams())


@pytest.mark.parametrize(
    ("field", "value"),
    [("rank", 1024), ("rank", 1), ("dropout", 0.0), ("learning_rate", 1), ("max_seq_len", 8)],
)
def test_what_the_struct_accepts_at_its_bounds_the_script_accepts(
    trainer_module: ModuleType, field: str, value: object
) -> None:
    msgspec.convert({field: value}, TrainerParams)
    assert getattr(trainer_module.parse_params({field: value}), field) == value


@pytest.mark.parametrize(
    ("field", "value"),
    [("rank", 1025), ("rank", 0), ("dropout", 1.0), ("learning_rate", 0), ("max_seq_len", 7)],
)
def test_what_the_struct_refuses_at_its_bounds_the_script_refuses(
    trainer_module: ModuleType, field: str, value: object
) -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({field: value}, TrainerParams)
    with pytest.raises(trainer_module.BadInputError, match=f"params.{field}"):
        trainer_module.parse_params({field: value})
