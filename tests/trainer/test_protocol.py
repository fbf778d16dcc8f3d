"""Every line the real trainer prints decodes strictly as the schemas' TrainerLine."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from lorafleet_schemas.messages import TrainerLine, TrainerParams
from lorafleet_trainer.budget import failure_message
from lorafleet_trainer.jobfile import parse_params
from lorafleet_trainer.params import Params
from lorafleet_trainer.protocol import is_environment_failure
from tests.trainer.harness import TrainerRun, ndjson, qa_records, run_trainer, write_job


def _decode_strictly(run: TrainerRun) -> list[TrainerLine]:
    out = []
    for raw in run.raw_lines:
        line = msgspec.json.decode(raw, type=TrainerLine)  # type: ignore[arg-type]
        # msgspec ignores unknown fields: a field the schema lacks must fail too.
        assert msgspec.to_builtins(line) == json.loads(raw), raw
        out.append(line)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_every_line_of_a_training_run_decodes(
    trained: Callable[[str], tuple[TrainerRun, Path]], arch: str
) -> None:
    run, _ = trained(arch)
    lines = _decode_strictly(run)
    assert len(lines) == len(run.raw_lines) > 24
    assert {type(x).__name__ for x in lines} == {
        "TrainerLog",
        "TrainerState",
        "TrainerStep",
        "TrainerEval",
        "TrainerDone",
        "TrainerLengths",
    }


def test_the_first_line_says_who_the_trainer_runs_as(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    job = write_job(
        tmp_path / "j", tiny_model("llama"), data=ndjson(qa_records()), params={"rank": 0}
    )
    run = run_trainer(job)
    lines = _decode_strictly(run)
    assert run.lines[0]["event"] == "log"
    assert run.lines[0]["message"].startswith(f"uid={os.getuid()} gid={os.getgid()} ")
    assert type(lines[-1]).__name__ == "TrainerError"


def test_a_missing_job_file_is_an_error_line(tmp_path: Path) -> None:
    run = run_trainer(tmp_path / "job.json")
    _decode_strictly(run)
    assert run.rc == 2
    assert run.lines[-1] == {
        "event": "error",
        "message": f"the job file {tmp_path / 'job.json'} does not exist",
    }


def test_a_schema_field_the_trainer_would_drop_fails_the_check() -> None:
    """The strict check itself: an unknown field or a wrong type does not pass."""
    extra = '{"event":"eval","step":1,"epoch":1,"eval_loss":1.0,"extra":2}'
    with pytest.raises(AssertionError):
        _decode_strictly(TrainerRun(0, [extra], [json.loads(extra)], ""))
    wrong = '{"event":"step","step":1,"steps":2,"loss":"low"}'
    with pytest.raises(msgspec.ValidationError):
        _decode_strictly(TrainerRun(0, [wrong], [json.loads(wrong)], ""))


def test_the_trainers_parameters_are_the_schemas() -> None:
    """Params (generated: the trainer cannot import the schemas) has every
    TrainerParams field with the same default, and accepts what it encodes."""
    import dataclasses

    ours = {f.name: f.default for f in dataclasses.fields(Params)}
    theirs = msgspec.to_builtins(TrainerParams())
    assert ours == theirs
    assert dataclasses.asdict(parse_params(theirs)) == theirs
    bounded = TrainerParams(rank=1024, dropout=0.0, epochs=1000, max_seq_len=8, eval_fraction=0)
    parse_params(msgspec.to_builtins(bounded))


def test_running_out_of_card_memory_says_what_to_change() -> None:
    """What __main__ makes of torch's out-of-memory error raised before the
    job file parsed: the job's own failure (exit 1), with what to change."""
    import torch

    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert not is_environment_failure(oom)  # so ExitCode.JOB_FAILED
    assert failure_message(oom, None) == (
        "the card ran out of memory, asking for 2.00 GiB more; lower batch_size "
        "or max_seq_len (raising gradient_accumulation keeps the batch), turn on "
        "gradient_checkpointing, or give the job more gpu_memory_mib"
    )
