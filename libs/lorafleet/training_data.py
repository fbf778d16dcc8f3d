"""Checking training data on its way in (the recorder at submit, the gateway
at upload): NDJSON records, one JSON object a line.

The records' format is lorafleet_trainer.records (one rule, the trainer's
too); this answers an upload's record count and sha256, or a DataError
naming the line (counted from 1) and what to change. Pure code: no bus, no
database.

`validate` checks data held whole. `LineSplitter` and `check_lines` check
it as it arrives (the gateway's upload): the splitter cuts what came so far
at its last newline, and each piece of whole lines is checked apart, with
the number of its first line, wherever it is convenient (a worker process).
"""

from __future__ import annotations

import hashlib

import msgspec

from lorafleet_trainer.records import SHAPES, RecordError, record_of

_decoder = msgspec.json.Decoder()

EMPTY_MESSAGE = f"the data is empty: give at least one record, {SHAPES}, one a line"


class DataError(ValueError):
    """Training data that is not NDJSON records; `line` is 1-based, 0 for the whole."""

    def __init__(self, message: str, line: int = 0) -> None:
        super().__init__(f"line {line}: {message}" if line else message)
        self.reason = message
        self.line = line

    def __reduce__(self) -> tuple[type[DataError], tuple[str, int]]:
        # Raised in a worker process and unpickled in the caller's: rebuilt
        # from its own arguments, not from the message (which has the line).
        return DataError, (self.reason, self.line)


def validate(data: bytes | str, kind: str | None = None) -> tuple[int, str]:
    """Check NDJSON training data, each record of `kind` (a job's method;
    None: either); return (records, sha256 hex of the exact bytes)."""
    raw = data.encode() if isinstance(data, str) else bytes(data)
    if not raw.strip():
        raise DataError(EMPTY_MESSAGE)
    return check_lines(raw, 1, kind), hashlib.sha256(raw).hexdigest()


def check_lines(piece: bytes, first_line: int, kind: str | None = None) -> int:
    """The records in `piece`, whole lines of the data whose first is line
    `first_line`, each of `kind` (None: either: an upload's job is not known
    yet, its submit checks the kind); DataError naming the line of the first
    bad one."""
    try:
        text = piece.decode("utf-8")
    except UnicodeDecodeError as e:
        line = first_line + piece[: e.start].count(b"\n")
        raise DataError("the data is not UTF-8 text", line) from None
    records = 0
    for number, line_text in enumerate(text.split("\n"), start=first_line):
        if not line_text.strip():
            continue
        try:
            record_of(_decoder.decode(line_text), number, kind)
        except msgspec.DecodeError as e:
            raise DataError(
                f"not valid JSON ({e}): each line is one record, {SHAPES}", number
            ) from None
        except RecordError as e:
            raise DataError(e.reason, e.line) from None
        records += 1
    return records


class LineSplitter:
    """Data as it arrives, cut into pieces of whole lines for `check_lines`.

    Costs a copy of each piece (the bytes after its last newline are kept
    for the next one); a newline never falls inside a UTF-8 character, so
    each piece decodes alone.
    """

    def __init__(self) -> None:
        self._rest = b""
        self._next_line = 1
        #: Whether any byte that is not whitespace came (else the data is empty).
        self.nonblank = False

    def take(self, data: bytes) -> tuple[bytes, int] | None:
        """`data`, the next bytes: the whole lines it completes and the
        number of the first of them; None while no line is complete."""
        if not self.nonblank and data.strip():
            self.nonblank = True
        cut = data.rfind(b"\n") + 1
        if not cut:
            self._rest += data
            return None
        piece = self._rest + data[:cut] if self._rest else data[:cut]
        self._rest = data[cut:]
        return self._piece(piece)

    def end(self) -> tuple[bytes, int] | None:
        """The last line, when the data does not end in a newline; DataError
        when no record came at all."""
        if not self.nonblank:
            raise DataError(EMPTY_MESSAGE)
        rest, self._rest = self._rest, b""
        return self._piece(rest) if rest else None

    def _piece(self, piece: bytes) -> tuple[bytes, int]:
        first = self._next_line
        self._next_line += piece.count(b"\n")
        return piece, first
