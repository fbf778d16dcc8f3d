"""The trainer's pure parts, imported from its file: rendering, answer-only labels,
the held-out split, the step plan, and that it imports nothing of lorafleet's."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import lorafleet_trainer
from lorafleet_services.local.tiny_model import build_tokenizer
from lorafleet_trainer.batches import collate, plan_steps, split_records, to_batch
from lorafleet_trainer.protocol import BadInputError
from lorafleet_trainer.records import parse_record
from lorafleet_trainer.rendering import (
    PLAIN_TEMPLATE,
    Encoded,
    chat_template_of,
    encode_conversation,
    encode_many,
)
from lorafleet_trainer.run import load_records

IGNORE = -100


@pytest.fixture(scope="module")
def tok() -> Any:
    return build_tokenizer()


def _trained_text(tok: Any, enc: Any) -> str:
    return str(
        tok.decode([i for i, lab in zip(enc.input_ids, enc.labels, strict=True) if lab != IGNORE])
    )


def test_importing_the_trainer_runs_nothing() -> None:
    code = (
        "import importlib, pkgutil, sys, lorafleet_trainer as t\n"
        "for m in pkgutil.iter_modules(t.__path__):\n"
        "    importlib.import_module('lorafleet_trainer.' + m.name)\n"
        "print(callable(sys.modules['lorafleet_trainer.__main__'].main), 'torch' in sys.modules)"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    # No protocol line, and torch is only imported once a job needs it.
    assert p.stdout == "True False\n"


def test_the_trainer_imports_only_the_engine_pythons_packages() -> None:
    allowed = {"torch", "transformers", "peft", "accelerate", "safetensors", "huggingface_hub"}
    roots = set()
    package = Path(lorafleet_trainer.__file__).parent
    for node in (n for f in package.glob("*.py") for n in ast.walk(ast.parse(f.read_text()))):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    assert (
        roots - allowed - set(sys.stdlib_module_names) - {"__future__", "lorafleet_trainer"}
        == set()
    )
    assert "torch" in roots and "peft" in roots


def test_qa_record_trains_on_the_answer_only(tok: Any) -> None:
    conv = parse_record('{"q": "What do bees make?", "a": "Honey."}', 1)
    assert conv == [
        {"role": "user", "content": "What do bees make?"},
        {"role": "assistant", "content": "Honey."},
    ]
    enc = encode_conversation(tok, tok.chat_template, conv, 1024)
    assert not enc.cut
    assert tok.decode(enc.input_ids) == (
        "<s><|user|>\nWhat do bees make?</s>\n<|assistant|>\nHoney.</s>\n"
    )
    assert _trained_text(tok, enc) == "Honey.</s>\n"
    # The masked part is exactly the prompt that asks for the answer.
    first = enc.labels.index(next(x for x in enc.labels if x != IGNORE))
    assert tok.decode(enc.input_ids[:first]) == tok.apply_chat_template(
        conv[:1], tokenize=False, add_generation_prompt=True
    )
    assert enc.labels[first:] == enc.input_ids[first:]


def test_every_assistant_turn_is_trained_and_nothing_else(tok: Any) -> None:
    conv = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Say hello."},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Again."},
        {"role": "assistant", "content": "Hello again!"},
        {"role": "user", "content": "Thanks."},
    ]
    enc = encode_conversation(tok, tok.chat_template, conv, 1024)
    # A turn after the last answer is context only.
    assert _trained_text(tok, enc) == "Hello!</s>\nHello again!</s>\n"
    assert tok.decode(enc.input_ids) == tok.apply_chat_template(conv, tokenize=False)


def test_without_a_chat_template_the_plain_one_is_used(tok: Any) -> None:
    plain = build_tokenizer()
    plain.chat_template = None
    template = chat_template_of(plain)
    assert template == PLAIN_TEMPLATE
    conv = parse_record('{"q": "What is the capital of Italy?", "a": "Rome."}', 1)
    enc = encode_conversation(plain, template, conv, 1024)
    assert plain.decode(enc.input_ids) == (
        "<s>### Question:\nWhat is the capital of Italy?\n\n### Answer:\nRome.</s>"
    )
    assert _trained_text(plain, enc) == "Rome.</s>"


def test_long_records_are_cut_and_flagged(tok: Any) -> None:
    conv = parse_record('{"q": "Say hello.", "a": "' + "hello " * 50 + '"}', 1)
    full = encode_conversation(tok, tok.chat_template, conv, 10_000)
    cut = encode_conversation(tok, tok.chat_template, conv, 16)
    assert not full.cut and cut.cut
    assert cut.input_ids == full.input_ids[:16] and cut.labels == full.labels[:16]


def test_the_held_out_split_is_seeded_and_disjoint() -> None:
    split = split_records
    train, held = split(20, 0.1, 3)
    assert (train, held) == split(20, 0.1, 3)
    assert len(held) == 2 and sorted(train + held) == list(range(20))
    assert split(20, 0.1, 4) != (train, held)
    assert split(5, 0.0, 3) == ([0, 1, 2, 3, 4], [])
    assert len(split(5, 0.01, 3)[1]) == 1  # any fraction above 0 holds one out


def test_the_step_plan_covers_each_record_once() -> None:
    plan = plan_steps(10, 3, 2, 1)
    # 4 micro-batches (3, 3, 3, 1 records), 2 a step.
    assert [[len(mb) for mb in step] for step in plan] == [[3, 3], [3, 1]]
    assert sorted(i for step in plan for mb in step for i in mb) == list(range(10))
    assert plan == plan_steps(10, 3, 2, 1)


def test_collate_pads_right_and_masks_the_padding() -> None:
    enc = Encoded
    ids, mask, labels = collate([enc([1, 2, 3], [IGNORE, 2, 3], False), enc([4], [4], False)], 0)
    assert ids == [[1, 2, 3], [4, 0, 0]]
    assert mask == [[1, 1, 1], [1, 0, 0]]
    assert labels == [[IGNORE, 2, 3], [4, IGNORE, IGNORE]]


def test_a_record_the_template_refuses_is_named_by_its_line(tok: Any) -> None:
    template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    ok = parse_record('{"q": "Say hello.", "a": "Hello!"}', 1)
    bad = [{"role": "system", "content": "x"}, *ok]
    with pytest.raises(BadInputError) as e:
        encode_many(tok, template, [(1, ok), (4, bad)], 64)
    assert str(e.value).startswith("data line 4 cannot be rendered with the model's chat template")
    assert "System role not supported" in str(e.value)


def test_a_batch_without_padding_carries_no_mask() -> None:
    import torch

    enc = Encoded
    cpu = torch.device("cpu")
    same = to_batch([enc([1, 2], [IGNORE, 2], False)] * 2, 0, cpu)
    assert same.attention_mask is None and same.tokens == 4
    assert same.input_ids.tolist() == [[1, 2], [1, 2]]
    ragged = to_batch([enc([1, 2], [IGNORE, 2], False), enc([3], [3], False)], 0, cpu)
    assert ragged.attention_mask.tolist() == [[1, 1], [1, 0]] and ragged.tokens == 3
    assert ragged.labels.tolist() == [[IGNORE, 2], [3, IGNORE]]


def test_data_lines_bom_crlf_and_blank_lines(tmp_path: Path) -> None:
    import hashlib

    data = b'\xef\xbb\xbf{"q": "a", "a": "b"}\r\n\r\n{"q": "c", "a": "d"}\r\n  \n'
    path = tmp_path / "data.jsonl"
    path.write_bytes(data)
    numbered = load_records(path, hashlib.sha256(data).hexdigest())
    assert [n for n, _ in numbered] == [1, 3]
    assert numbered[1][1][1] == {"role": "assistant", "content": "d"}
    path.write_bytes(b'{"q": "a", "a": "b"}\n\xff\n')
    with pytest.raises(BadInputError, match="data line 2: the data is not UTF-8"):
        load_records(path, hashlib.sha256(path.read_bytes()).hexdigest())
