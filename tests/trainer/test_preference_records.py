"""Preference records (a DPO job's): lorafleet's {"prompt", "chosen",
"rejected"} and OpenAI's {"input", "preferred_output", "non_preferred_output"},
one rule (lorafleet_trainer.records) read the same by the recorder at submit,
the gateway at upload and the trainer; every refusal names the line and the
field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lorafleet.training_data import DataError, check_lines, validate
from lorafleet_trainer.records import (
    PREFERENCE,
    SUPERVISED,
    Preference,
    RecordError,
    read_lines,
    read_preferences,
)

OWN = {"prompt": "What is the capital of France?", "chosen": "Paris.", "rejected": "Rome."}
OPENAI = {
    "input": {"messages": [{"role": "system", "content": "Be brief."},
                           {"role": "user", "content": "What is the capital of France?"}]},
    "preferred_output": [{"role": "assistant", "content": "Paris."}],
    "non_preferred_output": [{"role": "assistant", "content": "Rome."}],
}  # fmt: skip

#: (record, the words its refusal must hold: the field and what is wrong).
BAD = [
    ({"prompt": "q", "chosen": "a"}, 'no "rejected"'),
    ({"prompt": "q", "chosen": "a", "rejected": "b", "score": 1}, 'unknown key "score"'),
    ({"prompt": "q", "chosen": "", "rejected": "b"}, '"chosen" is empty'),
    ({"prompt": "q", "chosen": "a", "rejected": 3}, '"rejected" must be a string'),
    ({"prompt": "q", "chosen": "same", "rejected": "same"}, "are the same"),
    ({"prompt": [{"role": "assistant", "content": "x"}], "chosen": "a", "rejected": "b"},
     '"prompt" must end with a user turn'),
    ({**OPENAI, "input": {"messages": [{"role": "user", "content": "q"}], "tools": []}},
     '"input" must be {"messages": [turns]}'),
    ({**OPENAI, "preferred_output": [{"role": "user", "content": "a"}]},
     '"preferred_output" must hold exactly one assistant turn'),
    ({**OPENAI, "non_preferred_output": [{"role": "assistant", "content": "a", "x": 1}]},
     'non_preferred_output[0] has the unknown key "x"'),
    ({**OPENAI, "input": {"messages": [{"role": "robot", "content": "q"}]}},
     "input.messages[0].role is 'robot'"),
]  # fmt: skip


def _ndjson(*records: object) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def test_both_forms_read_as_the_same_pair(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(_ndjson(OWN, OPENAI))
    (n1, own), (n2, openai) = read_preferences(path)
    assert (n1, n2) == (1, 2)
    assert own == Preference([{"role": "user", "content": OWN["prompt"]}], "Paris.", "Rome.")
    assert openai.prompt[0] == {"role": "system", "content": "Be brief."}
    assert (openai.chosen, openai.rejected) == ("Paris.", "Rome.")
    chosen, rejected = own.conversations()
    assert chosen[-1] == {"role": "assistant", "content": "Paris."}
    assert rejected[:-1] == chosen[:-1] and rejected[-1]["content"] == "Rome."


@pytest.mark.parametrize(("record", "words"), BAD, ids=[w[:30] for _, w in BAD])
def test_a_bad_pair_is_refused_alike_everywhere_naming_line_and_field(
    record: object, words: str, tmp_path: Path
) -> None:
    """The trainer, the recorder at submit and the gateway's upload check say
    the same words, with the line (2: after a good one)."""
    text = _ndjson(OWN, record)
    path = tmp_path / "d.jsonl"
    path.write_text(text)
    with pytest.raises(RecordError) as trainer:
        read_lines(path, PREFERENCE)
    with pytest.raises(DataError) as submit:
        validate(text, PREFERENCE)
    with pytest.raises(DataError) as upload:
        check_lines(text.encode(), 1)
    assert trainer.value.line == submit.value.line == upload.value.line == 2
    assert words in trainer.value.reason, trainer.value.reason
    assert str(trainer.value) == str(submit.value) == str(upload.value)


def test_the_kind_must_be_the_jobs_method() -> None:
    """An upload takes either kind (its job is not known yet); a submit takes
    only the kind of its method, naming the first line of the other."""
    supervised = {"q": "a", "a": "b"}
    assert validate(_ndjson(supervised, OWN))[0] == 2
    with pytest.raises(DataError) as dpo:
        validate(_ndjson(OWN, supervised), PREFERENCE)
    assert dpo.value.line == 2 and "a supervised record, but the job's method is dpo" in str(
        dpo.value
    )
    with pytest.raises(DataError) as sft:
        validate(_ndjson(supervised, OPENAI), SUPERVISED)
    assert sft.value.line == 2 and "a dpo record, but the job's method is supervised" in str(
        sft.value
    )
