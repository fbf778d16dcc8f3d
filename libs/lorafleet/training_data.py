"""Checking training data on its way in (the recorder at submit, the gateway
at upload): NDJSON records, one JSON object a line.

The records' format is lorafleet_trainer.records (one rule, the trainer's
too); this answers an upload's record count and sha256, or a DataError
naming the line (counted from 1) and what to change. Pure code: no bus, no
database.
"""

from __future__ import annotations

import hashlib

import msgspec

from lorafleet_trainer.records import SHAPES, RecordError, conversation_of

_decoder = msgspec.json.Decoder()


class DataError(ValueError):
    """Training data that is not NDJSON records; `line` is 1-based, 0 for the whole."""

    def __init__(self, message: str, line: int = 0) -> None:
        super().__init__(f"line {line}: {message}" if line else message)
        self.line = line


def validate(data: bytes | str) -> tuple[int, str]:
    """Check NDJSON training data; return (records, sha256 hex of the exact bytes)."""
    raw = data.encode() if isinstance(data, str) else bytes(data)
    if not raw.strip():
        raise DataError(f"the data is empty: give at least one record, {SHAPES}, one a line")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise DataError("the data is not UTF-8 text", line) from None
    records = 0
    for number, line_text in enumerate(text.split("\n"), start=1):
        if not line_text.strip():
            continue
        try:
            conversation_of(_decoder.decode(line_text), number)
        except msgspec.DecodeError as e:
            raise DataError(
                f"not valid JSON ({e}): each line is one record, {SHAPES}", number
            ) from None
        except RecordError as e:
            raise DataError(e.reason, e.line) from None
        records += 1
    return records, hashlib.sha256(raw).hexdigest()
