"""Checking training data: NDJSON records, one JSON object a line.

A record is either `{"q": "...", "a": "..."}` (non-empty strings) or
`{"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}`
with at least one user and one assistant turn. Blank lines are skipped.
Anything else is a DataError naming the line (counted from 1) and what to
change. Pure code: no bus, no database.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

_ROLES = ("system", "user", "assistant")
_SHAPES = '{"q": "...", "a": "..."} or {"messages": [{"role": ..., "content": ...}, ...]}'

_decoder = msgspec.json.Decoder()


class DataError(ValueError):
    """Training data that is not NDJSON records; `line` is 1-based, 0 for the whole."""

    def __init__(self, message: str, line: int = 0) -> None:
        super().__init__(f"line {line}: {message}" if line else message)
        self.line = line


def _check_qa(record: dict[str, Any], line: int) -> None:
    for key in ("q", "a"):
        if key not in record:
            raise DataError(f'the record has no "{key}": each record is {_SHAPES}', line)
        value = record[key]
        if not isinstance(value, str):
            raise DataError(f'"{key}" must be a string, not {type(value).__name__}', line)
        if not value.strip():
            raise DataError(f'"{key}" is empty: give the text', line)


def _check_messages(record: dict[str, Any], line: int) -> None:
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise DataError('"messages" must be a non-empty list of {"role", "content"} turns', line)
    roles: set[str] = set()
    for i, turn in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(turn, dict):
            raise DataError(f'{where} must be an object {{"role": ..., "content": ...}}', line)
        extra = sorted(set(turn) - {"role", "content"})
        if extra:
            raise DataError(
                f'{where} has the unknown key "{extra[0]}": a turn has only "role" and "content"',
                line,
            )
        role = turn.get("role")
        if role not in _ROLES:
            raise DataError(f'{where}.role is {role!r}: use "system", "user" or "assistant"', line)
        content = turn.get("content")
        if not isinstance(content, str):
            raise DataError(f"{where}.content must be a string", line)
        roles.add(role)
    for needed in ("user", "assistant"):
        if needed not in roles:
            raise DataError(f'"messages" has no {needed} turn: give at least one', line)


def check_record(record: Any, line: int) -> None:
    """Raise DataError when `record` (decoded JSON) is not a training record."""
    if not isinstance(record, dict):
        raise DataError(f"expected a JSON object {_SHAPES}, got {type(record).__name__}", line)
    if "messages" in record:
        allowed = {"messages"}
        check = _check_messages
    else:
        allowed = {"q", "a"}
        check = _check_qa
    extra = sorted(set(record) - allowed)
    if extra:
        raise DataError(f'unknown key "{extra[0]}": each record is {_SHAPES}, nothing else', line)
    check(record, line)


def validate(data: bytes | str) -> tuple[int, str]:
    """Check NDJSON training data; return (records, sha256 hex of the exact bytes)."""
    raw = data.encode() if isinstance(data, str) else bytes(data)
    if not raw.strip():
        raise DataError(f"the data is empty: give at least one record, {_SHAPES}, one a line")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise DataError("the data is not UTF-8 text", line) from None
    records = 0
    # NDJSON lines end at "\n" only (as the trainer reads them): a JSON string
    # may hold U+2028 or "\r", which str.splitlines() would cut.
    for number, line_text in enumerate(text.split("\n"), start=1):
        if not line_text.strip():
            continue
        try:
            record = _decoder.decode(line_text)
        except msgspec.DecodeError as e:
            raise DataError(
                f"not valid JSON ({e}): each line is one record, {_SHAPES}", number
            ) from None
        check_record(record, number)
        records += 1
    return records, hashlib.sha256(raw).hexdigest()
