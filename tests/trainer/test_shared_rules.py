"""The rules the trainer shares with the control plane, each defined once in
lorafleet_trainer and read the same on both sides: the records' format (the
recorder at submit, the trainer at training), the job file (the agent writes,
the trainer reads), the line events and exit codes (the agent decodes)."""

from __future__ import annotations

import json
import typing
from pathlib import Path

import msgspec
import pytest

from lorafleet.training_data import DataError, validate
from lorafleet_schemas.messages import TrainerLine, TrainerParams
from lorafleet_trainer.jobfile import Base, JobFile, Resume
from lorafleet_trainer.params import Params
from lorafleet_trainer.protocol import BadInputError, Event, ExitCode
from lorafleet_trainer.records import RecordError, read_records

RECORDS = [
    {"q": "a", "a": "b"},
    {"q": "", "a": "b"},
    {"q": "a", "a": "  "},
    {"q": "a"},
    {"q": "a", "a": "b", "id": 1},
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
    {"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}]},
    {"messages": [{"role": "assistant", "content": "a"}]},
    {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]},
    {"messages": [{"role": "user", "content": "q", "name": "x"}, {"role": "assistant"}]},
    {"messages": [{"role": "user", "content": "q"}, {"role": "robot", "content": "a"}]},
    {"messages": []},
    ["not", "a", "record"],
]


def _recorder_says(text: str) -> str:
    try:
        validate(text)
    except DataError as e:
        return str(e)
    return "taken"


def _trainer_says(path: Path) -> str:
    try:
        read_records(path)
    except RecordError as e:
        return str(e)
    return "taken"


@pytest.mark.parametrize("record", RECORDS, ids=[json.dumps(r)[:40] for r in RECORDS])
def test_the_recorder_and_the_trainer_take_and_refuse_the_same_records(
    record: object, tmp_path: Path
) -> None:
    """Both take it, or both refuse it with the same words naming the same line."""
    text = '{"q": "first", "a": "line"}\n' + json.dumps(record) + "\n"
    path = tmp_path / "data.jsonl"
    path.write_text(text)
    assert _recorder_says(text) == _trainer_says(path)


def test_the_job_file_written_is_the_job_file_read(tmp_path: Path) -> None:
    job = JobFile(
        job_id="j1",
        base=Base(hf_repo="org/model", hf_revision="main", local_dir=None),
        data_path=tmp_path / "data.jsonl",
        data_sha256="0" * 64,
        out_dir=tmp_path / "out",
        params=Params(rank=8, target_modules=["q_proj"]),
        device="cpu",
        gpu_memory_mib=4000,
        checkpoint_dir=tmp_path / "checkpoints",
        resume=Resume(dir=tmp_path / "ckpt", mode="continue"),
    )
    assert JobFile.parse(json.loads(job.to_json())) == job
    # Every TrainerParams field travels, by the same name.
    assert set(json.loads(job.to_json())["params"]) == set(TrainerParams.__struct_fields__)


def test_a_bad_job_file_names_the_key() -> None:
    raw = json.loads(
        JobFile(
            job_id="j1",
            base=Base(hf_repo=None, hf_revision="main", local_dir="/m"),
            data_path=Path("/d"),
            data_sha256="0" * 64,
            out_dir=Path("/o"),
        ).to_json()
    )
    with pytest.raises(BadInputError, match="the job's device is 'tpu'"):
        JobFile.parse({**raw, "device": "tpu"})
    with pytest.raises(BadInputError, match=r"params\.rank is 0"):
        JobFile.parse({**raw, "params": {"rank": 0}})
    with pytest.raises(BadInputError, match="exactly one of hf_repo and local_dir"):
        JobFile.parse({**raw, "base": {"hf_repo": "a/b", "local_dir": "/m"}})


def test_the_line_events_are_the_schemas() -> None:
    tags = {msgspec.inspect.type_info(t).tag for t in typing.get_args(TrainerLine)}
    assert tags == {str(e) for e in Event}


def test_the_exit_codes_are_pinned() -> None:
    """The agent tells a retryable failure by them (agent/training/job_run.py trainer_failure)."""
    assert [int(c) for c in ExitCode] == [0, 1, 2, 3, 143]
