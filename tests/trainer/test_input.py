"""Bad parameters, bad data and a wrong sha256 are refused before any weight is loaded."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.trainer.harness import TrainerRun, ndjson, qa_records, run_trainer, write_job


def _refused(run: TrainerRun, job_dir: Path) -> str:
    """The run failed as bad input before loading anything; answer its error message."""
    assert run.rc == 2, run.stderr[-2000:]
    assert run.lines[-1]["event"] == "error"
    assert [x["event"] for x in run.lines].count("error") == 1
    # Nothing was loaded: no state line (the first is "preparing"), no step, no output.
    assert run.states() == []
    assert not (job_dir / "out").exists()
    return str(run.lines[-1]["message"])


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ({"rank": 0}, "params.rank is 0; it must be between 1 and 1024"),
        ({"rank": 2.5}, "params.rank is 2.5; it must be an integer"),
        ({"alpha": 0}, "params.alpha"),
        ({"dropout": 1.0}, "params.dropout"),
        ({"learning_rate": 3}, "params.learning_rate is 3; it must be above 0 and at most 1"),
        ({"learning_rate": "fast"}, "params.learning_rate"),
        ({"epochs": 0}, "params.epochs"),
        ({"max_steps": -1}, "params.max_steps"),
        ({"batch_size": True}, "params.batch_size"),
        ({"gradient_accumulation": 0}, "params.gradient_accumulation"),
        ({"max_seq_len": 4}, "params.max_seq_len"),
        ({"target_modules": []}, "params.target_modules"),
        ({"target_modules": "q_proj"}, "params.target_modules"),
        ({"lr_scheduler": "exp"}, "params.lr_scheduler"),
        ({"dtype": "fp8"}, "params.dtype"),
        ({"eval_fraction": 1}, "params.eval_fraction"),
        ({"gradient_checkpointing": "yes"}, "params.gradient_checkpointing"),
        ({"ranks": 8}, "params.ranks is not a trainer parameter"),
    ],
)
def test_bad_parameters_are_refused_by_name(
    tiny_model: Callable[[str], Path], tmp_path: Path, params: dict[str, Any], named: str
) -> None:
    job = write_job(tmp_path / "j", tiny_model("llama"), data=ndjson(qa_records()), params=params)
    assert named in _refused(run_trainer(job), tmp_path / "j")


def test_eval_fraction_that_leaves_nothing_to_train_on(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    job = write_job(
        tmp_path / "j",
        tiny_model("llama"),
        data=ndjson(qa_records()[:1]),
        params={"eval_fraction": 0.5},
    )
    message = _refused(run_trainer(job), tmp_path / "j")
    assert "params.eval_fraction 0.5 of 1 records leaves none to train on" in message


@pytest.mark.parametrize(
    ("line3", "named"),
    [
        ('{"q": "no answer"', "data line 3: not valid JSON"),
        ('{"q": "a question"}', 'data line 3: the record has no "a": each record is {"q"'),
        ('{"q": "x", "a": 5}', 'data line 3: "a" must be a string'),
        ('{"q": "x", "a": ""}', 'data line 3: "a" is empty'),
        ('{"q": " ", "a": "x"}', 'data line 3: "q" is empty'),
        ("[1, 2]", "data line 3: expected a JSON object"),
        ('{"messages": []}', 'data line 3: "messages" must be a non-empty list'),
        ('{"messages": [{"role": "bot", "content": "hi"}]}', "data line 3: messages[0].role"),
        (
            '{"messages": [{"role": "system", "content": "a"}, {"role": "user", "content": "q"}]}',
            'data line 3: "messages" has no assistant turn',
        ),
        ('{"messages": [{"role": "assistant", "content": "a"}]}', "has no user turn"),
        (
            '{"messages": [{"role": "user", "content": "q", "name": "x"}, '
            '{"role": "assistant", "content": "a"}]}',
            'data line 3: messages[0] has the unknown key "name"',
        ),
    ],
)
def test_a_bad_data_line_is_refused_by_number(
    tiny_model: Callable[[str], Path], tmp_path: Path, line3: str, named: str
) -> None:
    lines = [json.dumps(r) for r in qa_records(1)]
    lines.insert(2, line3)
    job = write_job(tmp_path / "j", tiny_model("llama"), data="\n".join(lines) + "\n")
    assert named in _refused(run_trainer(job), tmp_path / "j")


def test_data_whose_sha256_differs_from_the_jobs_is_refused(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    data = ndjson(qa_records())
    other = hashlib.sha256(b"other data").hexdigest()
    job = write_job(tmp_path / "j", tiny_model("llama"), data=data, data_sha256=other)
    message = _refused(run_trainer(job), tmp_path / "j")
    actual = hashlib.sha256(data.encode()).hexdigest()
    assert message == f"the data's sha256 is {actual}, the job's is {other}"


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"base": {"hf_repo": "a/b", "local_dir": "/x"}}, "exactly one of hf_repo and local_dir"),
        ({"device": "tpu"}, "the job's device is 'tpu'"),
        ({"data_sha256": "ABC"}, "the job's data_sha256 is 'ABC'"),
        ({"data_path": "/nonexistent/data.jsonl"}, "the data file /nonexistent/data.jsonl"),
        ({"eval_data_path": "/e.jsonl"}, "eval_data_path and eval_data_sha256 go together"),
        (
            {"eval_data_path": "/nonexistent/e.jsonl", "eval_data_sha256": "0" * 64},
            "the eval data file /nonexistent/e.jsonl does not exist",
        ),
        # The evaluation set is checked as the data is (the trainer runs in the job's directory).
        (
            {"eval_data_path": "data.jsonl", "eval_data_sha256": "1" * 64},
            f"the eval data's sha256 is {hashlib.sha256(ndjson(qa_records()).encode()).hexdigest()}",  # noqa: E501
        ),
    ],
)
def test_a_bad_job_file_is_refused(
    tiny_model: Callable[[str], Path], tmp_path: Path, overrides: dict[str, Any], named: str
) -> None:
    job = write_job(tmp_path / "j", tiny_model("llama"), data=ndjson(qa_records()), **overrides)
    assert named in _refused(run_trainer(job), tmp_path / "j")


def test_fp16_on_the_cpu_is_refused(tiny_model: Callable[[str], Path], tmp_path: Path) -> None:
    job = write_job(
        tmp_path / "j", tiny_model("llama"), data=ndjson(qa_records()), params={"dtype": "fp16"}
    )
    message = _refused(run_trainer(job), tmp_path / "j")
    assert message == 'params.dtype "fp16" needs a card; on the CPU use "fp32", "bf16" or "auto"'


def test_target_modules_the_model_lacks_are_refused_before_the_weights_load(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    job = write_job(
        tmp_path / "j",
        tiny_model("qwen2"),
        data=ndjson(qa_records()),
        params={"target_modules": ["q_proj", "self_attn.v_proj", "qkv_proj"]},
    )
    run = run_trainer(job)
    assert run.rc == 2
    assert run.lines[-1]["message"] == (
        "params.target_modules names ['qkv_proj'], which this model does not have; its linear "
        "layers are ['down_proj', 'gate_proj', 'k_proj', 'lm_head', 'o_proj', 'q_proj', "
        """'up_proj', 'v_proj'] (or use "all-linear")"""
    )
    assert run.states() == ["preparing"]
    assert not [x for x in run.events("log") if "LoRA parameters" in x["message"]]
    assert not (tmp_path / "j" / "out").exists()


def test_a_base_without_safetensors_is_refused(tmp_path: Path) -> None:
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    (base / "pytorch_model.bin").write_bytes(b"pickles are not read")
    job = write_job(tmp_path / "j", base, data=ndjson(qa_records()))
    run = run_trainer(job)
    assert run.rc == 2
    assert run.lines[-1]["message"] == (
        f"no *.safetensors weights in {base}; only safetensors are read"
    )
