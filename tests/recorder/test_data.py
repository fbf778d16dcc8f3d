"""The NDJSON check: each bad record named by its line, and what to change."""

from __future__ import annotations

import hashlib
import json
import pickle

import pytest

from lorafleet.training_data import DataError, LineSplitter, check_lines, validate


def turn(role: str, content: object = "x") -> dict[str, object]:
    return {"role": role, "content": content}


def chat(*turns: dict[str, object]) -> str:
    return json.dumps({"messages": list(turns)})


GOOD_CHAT = chat(turn("system"), turn("user"), turn("assistant"))


def test_good_data_counts_records_and_hashes_exact_bytes() -> None:
    text = '{"q": "a", "a": "b"}\n\n   \n' + GOOD_CHAT + "\r\n"
    assert validate(text) == (2, hashlib.sha256(text.encode()).hexdigest())
    assert validate(text.encode())[1] == hashlib.sha256(text.encode()).hexdigest()


@pytest.mark.parametrize(
    ("text", "line", "words"),
    [
        ("", 0, "empty"),
        ("\n  \n", 0, "empty"),
        ('{"q": "a", "a": "b"}\n{"q": "a"}', 2, 'no "a"'),
        ('{"q": "", "a": "b"}', 1, '"q" is empty'),
        ('{"q": "a", "a": 5}', 1, '"a" must be a string'),
        ('{"q": "a", "a": "b", "extra": 1}', 1, 'unknown key "extra"'),
        ('\n\n"just a string"', 3, "expected a JSON object"),
        ("{oops", 1, "not valid JSON"),
        ('{"messages": []}', 1, "non-empty list"),
        (chat(turn("user")), 1, "no assistant turn"),
        (chat(turn("assistant")), 1, "no user turn"),
        (chat(turn("user"), turn("robot")), 1, "messages[1].role"),
        (chat(turn("user"), turn("assistant", 3)), 1, "messages[1].content"),
        (chat(turn("user"), {**turn("assistant"), "name": "x"}), 1, 'unknown key "name"'),
        (json.dumps({"messages": [turn("user"), turn("assistant")], "q": "x"}), 1, '"q"'),
    ],
)
def test_bad_data_names_the_line(text: str, line: int, words: str) -> None:
    with pytest.raises(DataError) as info:
        validate(text)
    assert info.value.line == line
    assert words in str(info.value)
    if line:
        assert str(info.value).startswith(f"line {line}: ")


def test_not_utf8_names_the_line() -> None:
    with pytest.raises(DataError, match="line 2: the data is not UTF-8"):
        validate(b'{"q": "a", "a": "b"}\n{"q": "\xff", "a": "b"}\n')


def test_line_separators_inside_a_string_do_not_split_a_record() -> None:
    # U+2028 and a raw CR are legal inside a JSON string; the trainer reads
    # lines split at "\n" only, so the recorder must count the same lines.
    text = '{"q": "one\u2028two", "a": "b"}\n{"q": "c\\r", "a": "d"}\n'
    assert validate(text)[0] == 2
    with pytest.raises(DataError) as e:
        validate('{"q": "x\u2028y", "a": "b"}\nnot json\n')
    assert e.value.line == 2


def check_in_pieces(data: bytes, step: int) -> int:
    """`data` checked as an upload is: fed `step` bytes at a time."""
    splitter = LineSplitter()
    pieces = [splitter.take(data[i : i + step]) for i in range(0, len(data), step)]
    pieces.append(splitter.end())
    return sum(check_lines(*p) for p in pieces if p is not None)


@pytest.mark.parametrize("step", [1, 7, 64, 10_000])
def test_data_checked_in_pieces_counts_and_names_lines_as_whole(step: int) -> None:
    good = ('{"q": "a", "a": "b"}\n\n  \n' + GOOD_CHAT + '\n{"q": "é\u2028", "a": "c"}').encode()
    assert check_in_pieces(good, step) == validate(good)[0] == 3
    for bad, line in [(good + b"\n{oops\n", 6), (b"\n" * 3 + b'{"q": "\xff", "a": "b"}', 4)]:
        with pytest.raises(DataError) as whole:
            validate(bad)
        with pytest.raises(DataError) as pieces:
            check_in_pieces(bad, step)
        assert (pieces.value.line, str(pieces.value)) == (whole.value.line, str(whole.value))
        assert pieces.value.line == line
    with pytest.raises(DataError, match="empty"):
        check_in_pieces(b"\n  \n", step)


def test_a_data_error_crosses_a_process_boundary_as_it_was() -> None:
    error = pickle.loads(pickle.dumps(DataError("the record has no answer", 7)))
    assert (str(error), error.line) == ("line 7: the record has no answer", 7)
