"""The training records' format: one rule, for the recorder and the trainer.

The data is NDJSON: one JSON object a line ("\\n" ends a line, nothing else:
a JSON string may hold U+2028 or "\\r"); blank lines are skipped. A record is

    {"q": "...", "a": "..."}                      both strings, not blank;
    {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}
                                                  at least one user and one
                                                  assistant turn, each turn
                                                  exactly "role" and "content".

{"q", "a"} is the conversation [user q, assistant a]. Every assistant turn is
trained on; turns after the last one are context only.

A preference record (a DPO job's, `PREFERENCE`) is one of

    {"prompt": "..." | [turns], "chosen": "...", "rejected": "..."}
    {"input": {"messages": [turns]},              OpenAI's preference format
     "preferred_output": [{"role": "assistant", "content": "..."}],
     "non_preferred_output": [{"role": "assistant", "content": "..."}]}

the prompt's turns as above, ending with a user turn; the two answers each
one non-empty assistant turn, not the same. Anything else is a `RecordError`
naming the line (counted from 1), the field and what to change.
`record_of(record, line, kind)` is the one rule: kind SUPERVISED or
PREFERENCE, or None for either (an upload, whose job is not known yet). The
recorder checks a job's data with it at submit (lorafleet.training_data),
the gateway an upload, the trainer its data file (`read_records`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

ROLES = ("system", "user", "assistant")
SHAPES = '{"q": "...", "a": "..."} or {"messages": [{"role": ..., "content": ...}, ...]}'

PREFERENCE_SHAPES = (
    '{"prompt": ..., "chosen": ..., "rejected": ...} or {"input": {"messages": [...]}, '
    '"preferred_output": [...], "non_preferred_output": [...]}'
)
#: The kinds of record (a job's method: TrainerParams.method).
SUPERVISED, PREFERENCE = "supervised", "dpo"

#: A record as the chat template reads it: [{"role", "content"}, ...].
Conversation = list[dict[str, str]]


@dataclasses.dataclass(frozen=True)
class Preference:
    """A preference pair: the prompt's turns (ending with a user turn) and
    the preferred and the other answer (the assistant's text)."""

    prompt: Conversation
    chosen: str
    rejected: str

    def conversations(self) -> tuple[Conversation, Conversation]:
        """(prompt + chosen, prompt + rejected) as conversations."""
        return tuple(  # type: ignore[return-value]
            [*self.prompt, {"role": "assistant", "content": answer}]
            for answer in (self.chosen, self.rejected)
        )


#: A record of either kind.
Record = Conversation | Preference


class RecordError(ValueError):
    """A data line that is not a training record; `line` is 1-based, 0 for
    the whole file; `reason` what is wrong and what to change."""

    def __init__(self, reason: str, line: int = 0) -> None:
        super().__init__(f"line {line}: {reason}" if line else reason)
        self.reason = reason
        self.line = line


def _qa(record: dict[str, Any], line: int) -> Conversation:
    for key in ("q", "a"):
        if key not in record:
            raise RecordError(f'the record has no "{key}": each record is {SHAPES}', line)
        value = record[key]
        if not isinstance(value, str):
            raise RecordError(f'"{key}" must be a string, not {type(value).__name__}', line)
        if not value.strip():
            raise RecordError(f'"{key}" is empty: give the text', line)
    return [{"role": "user", "content": record["q"]}, {"role": "assistant", "content": record["a"]}]


def _messages(record: dict[str, Any], line: int) -> Conversation:
    conv = _turns(record["messages"], "messages", line)
    for needed in ("user", "assistant"):
        if not any(m["role"] == needed for m in conv):
            raise RecordError(f'"messages" has no {needed} turn: give at least one', line)
    return conv


def _turns(messages: Any, name: str, line: int) -> Conversation:
    if not isinstance(messages, list) or not messages:
        raise RecordError(f'"{name}" must be a non-empty list of {{"role", "content"}} turns', line)
    conv: Conversation = []
    for i, turn in enumerate(messages):
        where = f"{name}[{i}]"
        if not isinstance(turn, dict):
            raise RecordError(f'{where} must be an object {{"role": ..., "content": ...}}', line)
        extra = sorted(set(turn) - {"role", "content"})
        if extra:
            raise RecordError(
                f'{where} has the unknown key "{extra[0]}": a turn has only "role" and "content"',
                line,
            )
        role = turn.get("role")
        if role not in ROLES:
            raise RecordError(
                f'{where}.role is {role!r}: use "system", "user" or "assistant"', line
            )
        content = turn.get("content")
        if not isinstance(content, str):
            raise RecordError(f"{where}.content must be a string", line)
        conv.append({"role": role, "content": content})
    return conv


def conversation_of(record: Any, line: int) -> Conversation:
    """`record` (decoded JSON) as a conversation; RecordError when it is not
    a training record."""
    if type(record) is dict and len(record) == 2:
        # The common good {"q", "a"} record, taken with the fewest steps (a
        # third of the time of the checks below, which any other meets: an
        # upload is checked record by record, bench/gateway.py).
        q, a = record.get("q"), record.get("a")
        if type(q) is str and type(a) is str and q.strip() and a.strip():
            return [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    if not isinstance(record, dict):
        raise RecordError(f"expected a JSON object {SHAPES}, got {type(record).__name__}", line)
    allowed = {"messages"} if "messages" in record else {"q", "a"}
    extra = sorted(set(record) - allowed)
    if extra:
        raise RecordError(f'unknown key "{extra[0]}": each record is {SHAPES}, nothing else', line)
    return _messages(record, line) if "messages" in record else _qa(record, line)


_OPENAI_KEYS = {"input", "preferred_output", "non_preferred_output"}
_OWN_KEYS = {"prompt", "chosen", "rejected"}
_PREFERENCE_KEYS = frozenset(_OPENAI_KEYS | _OWN_KEYS)


def _answer(value: Any, name: str, line: int) -> str:
    """An answer: a string (lorafleet's form) or OpenAI's list of one
    assistant turn."""
    if isinstance(value, list):
        turns = _turns(value, name, line)
        if len(turns) != 1 or turns[0]["role"] != "assistant":
            raise RecordError(f'"{name}" must hold exactly one assistant turn', line)
        value = turns[0]["content"]
    if not isinstance(value, str):
        raise RecordError(f'"{name}" must be a string, not {type(value).__name__}', line)
    if not value.strip():
        raise RecordError(f'"{name}" is empty: give the answer\'s text', line)
    return value


def _prompt(value: Any, name: str, line: int) -> Conversation:
    if isinstance(value, str):
        if not value.strip():
            raise RecordError(f'"{name}" is empty: give the text', line)
        return [{"role": "user", "content": value}]
    turns = _turns(value, name, line)
    if turns[-1]["role"] != "user":
        raise RecordError(f'"{name}" must end with a user turn (the answers follow it)', line)
    return turns


def preference_of(record: Any, line: int) -> Preference:
    """`record` (decoded JSON) as a preference pair; RecordError when it is not one."""
    if not isinstance(record, dict):
        raise RecordError(
            f"expected a JSON object {PREFERENCE_SHAPES}, got {type(record).__name__}", line
        )
    openai = "input" in record or "preferred_output" in record
    keys = _OPENAI_KEYS if openai else _OWN_KEYS
    extra, missing = sorted(set(record) - keys), sorted(keys - set(record))
    if extra or missing:
        what = f'unknown key "{extra[0]}"' if extra else f'no "{missing[0]}"'
        raise RecordError(f"{what}: each preference record is {PREFERENCE_SHAPES}", line)
    if not openai:
        prompt = _prompt(record["prompt"], "prompt", line)
        chosen, rejected = (_answer(record[k], k, line) for k in ("chosen", "rejected"))
    else:
        given = record["input"]
        if not isinstance(given, dict) or set(given) != {"messages"}:
            raise RecordError('"input" must be {"messages": [turns]} and nothing else', line)
        prompt = _prompt(given["messages"], "input.messages", line)
        chosen = _answer(record["preferred_output"], "preferred_output", line)
        rejected = _answer(record["non_preferred_output"], "non_preferred_output", line)
    if chosen == rejected:
        raise RecordError("the preferred and the other answer are the same: nothing to learn", line)
    return Preference(prompt, chosen, rejected)


def kind_of(record: Any) -> str:
    """The kind a record's keys say it is (its errors are the kind's)."""
    # isdisjoint over the dict's keys: no set built (an upload checks every record).
    if isinstance(record, dict) and not _PREFERENCE_KEYS.isdisjoint(record):
        return PREFERENCE
    return SUPERVISED


def record_of(record: Any, line: int, kind: str | None = None) -> Record:
    """`record` as a record of `kind` (None: either); RecordError naming the
    line and the field when it is not one, or is one of the other kind."""
    found = kind_of(record)
    if kind is not None and found != kind:
        shapes = PREFERENCE_SHAPES if kind == PREFERENCE else SHAPES
        raise RecordError(
            f"a {found} record, but the job's method is {kind}: each record is {shapes}", line
        )
    return preference_of(record, line) if found == PREFERENCE else conversation_of(record, line)


def _decoded(text: str, line: int, kind: str | None) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        shapes = PREFERENCE_SHAPES if kind == PREFERENCE else SHAPES
        raise RecordError(
            f"not valid JSON ({e.msg} at column {e.colno}): each line is one record, {shapes}",
            line,
        ) from None


def parse_record(text: str, line: int) -> Conversation:
    """One NDJSON line as a conversation."""
    return conversation_of(_decoded(text, line, SUPERVISED), line)


def parse_line(text: str, line: int, kind: str | None) -> Record:
    """One NDJSON line as a record of `kind` (None: either)."""
    return record_of(_decoded(text, line, kind), line, kind)


def file_sha256(path: Path) -> str:
    """The lowercase hex sha256 of the file's bytes."""
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def read_preferences(path: Path) -> list[tuple[int, Preference]]:
    """(line number, pair) of each non-blank line of a DPO job's data file."""
    return [(n, r) for n, r in read_lines(path, PREFERENCE) if isinstance(r, Preference)]


def read_records(path: Path) -> list[tuple[int, Conversation]]:
    """(line number, record) of each non-blank line of the data file at `path`."""
    return [(n, r) for n, r in read_lines(path, SUPERVISED) if not isinstance(r, Preference)]


def read_lines(path: Path, kind: str) -> list[tuple[int, Record]]:
    """(line number, record of `kind`) of each non-blank line of the file at `path`."""
    records: list[tuple[int, Record]] = []
    with path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                # A byte-order mark some editors write is not part of the record.
                text = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError:
                raise RecordError("the data is not UTF-8 text", number) from None
            if text.strip():
                records.append((number, parse_line(text, number, kind)))
    return records
