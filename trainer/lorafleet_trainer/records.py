"""The training records' format: one rule, for the recorder and the trainer.

The data is NDJSON: one JSON object a line ("\\n" ends a line, nothing else:
a JSON string may hold U+2028 or "\\r"); blank lines are skipped. A record is

    {"q": "...", "a": "..."}                      both strings, not blank;
    {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}
                                                  at least one user and one
                                                  assistant turn, each turn
                                                  exactly "role" and "content".

{"q", "a"} is the conversation [user q, assistant a]. Every assistant turn is
trained on; turns after the last one are context only. Anything else is a
`RecordError` naming the line (counted from 1) and what to change. The
recorder checks an upload with `conversation_of` (lorafleet_services.recorder.
data), the trainer reads its data file with `read_records`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

ROLES = ("system", "user", "assistant")
SHAPES = '{"q": "...", "a": "..."} or {"messages": [{"role": ..., "content": ...}, ...]}'

#: A record as the chat template reads it: [{"role", "content"}, ...].
Conversation = list[dict[str, str]]


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
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise RecordError('"messages" must be a non-empty list of {"role", "content"} turns', line)
    conv: Conversation = []
    for i, turn in enumerate(messages):
        where = f"messages[{i}]"
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
    for needed in ("user", "assistant"):
        if not any(m["role"] == needed for m in conv):
            raise RecordError(f'"messages" has no {needed} turn: give at least one', line)
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


def parse_record(text: str, line: int) -> Conversation:
    """One NDJSON line as a conversation."""
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise RecordError(
            f"not valid JSON ({e.msg} at column {e.colno}): each line is one record, {SHAPES}",
            line,
        ) from None
    return conversation_of(record, line)


def file_sha256(path: Path) -> str:
    """The lowercase hex sha256 of the file's bytes."""
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def read_records(path: Path) -> list[tuple[int, Conversation]]:
    """(line number, record) of each non-blank line of the data file at `path`."""
    records: list[tuple[int, Conversation]] = []
    with path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                # A byte-order mark some editors write is not part of the record.
                text = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError:
                raise RecordError("the data is not UTF-8 text", number) from None
            if text.strip():
                records.append((number, parse_record(text, number)))
    return records
