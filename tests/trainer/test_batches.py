"""Length-grouped batches, batched tokenization, and what a batch's padding may
not change: each record's logits, and the loss on answer tokens only."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from lorafleet_services.local.tiny_model import build_tokenizer
from lorafleet_trainer.batches import GROUP_WINDOW_BATCHES, plan_grouped, plan_steps, to_batch
from lorafleet_trainer.records import parse_record
from lorafleet_trainer.rendering import Tokens, _render, encode_conversation, encode_many, renderer
from tests.trainer.harness import QA

IGNORE = -100


@pytest.fixture(scope="module")
def tok() -> Any:
    return build_tokenizer()


def _long_tail(n: int, seed: int = 0) -> list[int]:
    """Token counts from 16 to 512, most short (a long-tailed distribution)."""
    rng = random.Random(seed)
    return [min(512, 16 + int(rng.paretovariate(1.2) * 16)) for _ in range(n)]


def _flat(plan: list[list[list[int]]]) -> list[int]:
    return [i for step in plan for mb in step for i in mb]


def _padding(plan: list[list[list[int]]], lengths: Sequence[int]) -> int:
    return sum(
        len(mb) * max(lengths[i] for i in mb) - sum(lengths[i] for i in mb)
        for step in plan
        for mb in step
    )


def test_grouped_batches_hold_each_record_once_with_little_padding() -> None:
    lengths = _long_tail(1000)
    train = list(range(1000))

    def plan(seed: int) -> list[list[list[int]]]:
        return plan_grouped(train, 4, 2, seed, lambda ids: [lengths[i] for i in ids])

    grouped = plan(1)
    assert sorted(_flat(grouped)) == train
    # ceil(1000 / 4) = 250 micro-batches, 2 a step; only the last may be short.
    assert [len(step) for step in grouped] == [2] * 125
    assert all(len(mb) == 4 for step in grouped for mb in step)
    assert plan(1) == grouped and plan(2) != grouped
    random_order = plan_steps(1000, 4, 2, 1)
    real = sum(lengths)
    assert _padding(random_order, lengths) > 0.3 * real
    assert _padding(grouped, lengths) < 0.1 * real  # buckets of about 1/8


def test_grouping_skips_records_without_an_answer_and_keeps_a_short_last_batch() -> None:
    lengths = [0 if i % 7 == 0 else 10 + i % 13 for i in range(602)]
    kept = [i for i, n in enumerate(lengths) if n]
    plan = plan_grouped(list(range(602)), 8, 1, 3, lambda ids: [lengths[i] for i in ids])
    assert sorted(_flat(plan)) == kept
    sizes = [len(mb) for step in plan for mb in step]
    assert sizes[:-1] == [8] * (len(sizes) - 1) and sizes[-1] == len(kept) % 8


def test_with_max_steps_only_the_windows_needed_are_read() -> None:
    asked: list[int] = []

    def lengths_of(ids: Sequence[int]) -> list[int]:
        asked.extend(ids)
        return [20 + i % 50 for i in ids]

    plan = plan_grouped(list(range(50_000)), 4, 1, 5, lengths_of, 5)
    assert len(plan) == 5
    # One window: 64 micro-batches of 4 records.
    assert len(asked) == 4 * GROUP_WINDOW_BATCHES


def test_batched_encoding_makes_the_same_tokens_as_record_by_record(tok: Any) -> None:
    records = [parse_record(f'{{"q": "{q}", "a": "{a}"}}', 1) for q, a in QA]
    records.append(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Say hello."},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "What do bees make?"},
            {"role": "assistant", "content": "Honey."},
        ]
    )
    for max_len in (1024, 12):
        one_by_one = [encode_conversation(tok, tok.chat_template, c, max_len) for c in records]
        numbered = list(enumerate(records, 1))
        assert encode_many(tok, tok.chat_template, numbered, max_len) == one_by_one
    assert any(e.cut for e in one_by_one)


def test_a_batched_call_turns_the_tokenizer_pool_on_only_for_itself(
    tok: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    seen: list[str | None] = []

    class Spy:
        def __call__(self, texts: list[str], **kw: Any) -> Any:
            seen.append(os.environ.get("TOKENIZERS_PARALLELISM"))
            return tok(texts, **kw)

        def __getattr__(self, name: str) -> Any:
            return getattr(tok, name)

    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    conv = parse_record('{"q": "Say hello.", "a": "Hello!"}', 1)
    encode_many(Spy(), tok.chat_template, [(1, conv)], 64)
    assert seen == ["true"] and os.environ["TOKENIZERS_PARALLELISM"] == "false"


def test_a_renderer_that_disagrees_with_the_tokenizer_falls_back(tok: Any) -> None:
    """The compiled fast path is checked against apply_chat_template: a tokenizer
    whose rendering differs (here: a changed eos) gets its own rendering."""
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    render = renderer(tok, tok.chat_template)
    assert render(conv, False) == _render(tok, tok.chat_template, conv, False)

    class Odd:
        def __init__(self) -> None:
            self.special_tokens_map = {**tok.special_tokens_map, "eos_token": "<wrong>"}

        def apply_chat_template(self, msgs: Any, **kw: Any) -> Any:
            return tok.apply_chat_template(msgs, **kw)

    odd = renderer(Odd(), tok.chat_template)
    assert odd(conv, False) == _render(tok, tok.chat_template, conv, False)
    assert "<wrong>" not in odd(conv, True)


def test_tokens_are_made_once_and_counted(tok: Any) -> None:
    parse = parse_record
    records = [(n, parse(f'{{"q": "{q}", "a": "{a}"}}', n)) for n, (q, a) in enumerate(QA, 1)]
    seen: list[int] = []
    tokens = Tokens(tok, tok.chat_template, records, 12, seen.append)
    first = tokens.get([0, 1])
    assert tokens.get([1, 0]) == first[::-1] and seen == [2]
    tokens.lengths(range(len(QA)))
    assert seen == [2, len(QA)] and tokens.done == len(QA)
    assert tokens.cut == len(QA)  # every record is over 12 tokens
    summary = tokens.length_summary()
    assert summary["max"] == 12 and summary["min"] <= summary["p50"] <= summary["p95"] <= 12


@pytest.fixture(scope="module")
def llama(tiny_model: Callable[[str], Path]) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=torch.float32)
    model.eval()
    return model


def _records(tok: Any) -> list[Any]:
    qa = [("Say hello.", "Hello! How can I help you today?"), ("What do bees make?", "Honey.")]
    qa.append(("What is the capital of France? " * 3, "The capital of France is Paris."))
    return [
        encode_conversation(
            tok,
            tok.chat_template,
            parse_record(f'{{"q": "{q}", "a": "{a}"}}', 1),
            256,
        )
        for q, a in qa
    ]


def test_a_record_in_a_batch_has_the_logits_it_has_alone(tok: Any, llama: Any) -> None:
    import torch

    records = _records(tok)
    assert len({len(e.input_ids) for e in records}) == 3  # padded to the longest
    cpu = torch.device("cpu")
    batch = to_batch(records, tok.pad_token_id, cpu)
    with torch.no_grad():
        together = llama(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        for row, e in enumerate(records):
            alone = llama(input_ids=torch.tensor([e.input_ids])).logits[0]
            n = len(e.input_ids)
            torch.testing.assert_close(together[row, :n], alone, rtol=1e-4, atol=1e-4)


def test_the_loss_is_on_answer_tokens_only(tok: Any, llama: Any) -> None:
    import torch
    import torch.nn.functional as F

    records = _records(tok)
    batch = to_batch(records, tok.pad_token_id, torch.device("cpu"))
    assert batch.padding == 3 * max(len(e.input_ids) for e in records) - batch.tokens
    with torch.no_grad():
        loss = llama(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.labels
        ).loss
        total, count = 0.0, 0
        for e in records:
            logits = llama(input_ids=torch.tensor([e.input_ids])).logits[0, :-1]
            answer = [k for k in range(1, len(e.labels)) if e.labels[k] != IGNORE]
            assert 0 < len(answer) < len(e.labels) - 1  # some prompt tokens carry no loss
            targets = torch.tensor([e.input_ids[k] for k in answer])
            total += float(
                F.cross_entropy(logits[[k - 1 for k in answer]], targets, reduction="sum")
            )
            count += len(answer)
    assert float(loss) == pytest.approx(total / count, rel=1e-5)
