"""Records as tokens: rendered with a chat template, the answers' tokens
labelled for the loss, tokenized in batches when first needed.

The template is the tokenizer's when it has one, else PLAIN_TEMPLATE
("### Question:\\n{q}\\n\\n### Answer:\\n{a}{eos}"). Only the assistant's
tokens carry loss (labels IGNORE elsewhere). Records longer than max_seq_len
are cut and counted; a record with no answer token left after the cut is
skipped and counted. No torch here: the tokenizer is transformers'.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from lorafleet_trainer.protocol import BadInputError
from lorafleet_trainer.records import Conversation

#: The template for tokenizers without one of their own (base models): one
#: "### System:" / "### Question:" / "### Answer:" block per message, blocks
#: separated by a blank line, each answer ended by the eos token, and a bos
#: token first when the tokenizer has one.
PLAIN_TEMPLATE = (
    "{% if bos_token %}{{ bos_token }}{% endif %}"
    "{% for message in messages %}"
    "{% if not loop.first %}{{ '\n\n' }}{% endif %}"
    "{% if message['role'] == 'system' %}{{ '### System:\n' + message['content'] }}"
    "{% elif message['role'] == 'user' %}{{ '### Question:\n' + message['content'] }}"
    "{% else %}{{ '### Answer:\n' + message['content'] + (eos_token or '') }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{% if messages %}{{ '\n\n' }}{% endif %}{{ '### Answer:\n' }}"
    "{% endif %}"
)

IGNORE = -100


@dataclasses.dataclass(frozen=True)
class Encoded:
    input_ids: list[int]
    #: IGNORE except on the assistant's tokens.
    labels: list[int]
    #: The record was longer than max_seq_len and was cut.
    cut: bool

    @property
    def answer_tokens(self) -> int:
        return sum(1 for x in self.labels if x != IGNORE)


def chat_template_of(tokenizer: Any) -> str:
    """The template the trainer renders with: the tokenizer's, else PLAIN_TEMPLATE."""
    t = getattr(tokenizer, "chat_template", None)
    if isinstance(t, dict):
        t = t.get("default") or next(iter(t.values()), None)
    return t if isinstance(t, str) and t else PLAIN_TEMPLATE


def _render(tokenizer: Any, template: str, msgs: Conversation, generation: bool) -> str:
    out = tokenizer.apply_chat_template(
        msgs, chat_template=template, tokenize=False, add_generation_prompt=generation
    )
    if not isinstance(out, str):
        raise TypeError(f"apply_chat_template answered {type(out).__name__}, not text")
    return out


#: Renders a conversation (with add_generation_prompt or not) as text.
Render = Callable[[Conversation, bool], str]


def renderer(tokenizer: Any, template: str) -> Render:
    """A render function for `template`, compiled once.

    apply_chat_template recompiles nothing but still costs tens of microseconds
    a call in argument handling, and a record takes three calls. The compiled
    template (transformers' own compiler, so the same sandbox and filters) is
    rendered directly with the tokenizer's special tokens; the first 16 calls
    are checked against apply_chat_template and on any difference (or a
    transformers without the compiler) every call goes through it instead.
    """

    def slow(msgs: Conversation, generation: bool) -> str:
        return _render(tokenizer, template, msgs, generation)

    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        compiled = _compile_jinja_template(template)
        kwargs = dict(tokenizer.special_tokens_map)
    except Exception:
        return slow
    state: dict[str, Any] = {"checks_left": 16, "fast": True}

    def fast(msgs: Conversation, generation: bool) -> str:
        if not state["fast"]:
            return slow(msgs, generation)
        text = str(
            compiled.render(
                messages=msgs,
                tools=None,
                documents=None,
                add_generation_prompt=generation,
                **kwargs,
            )
        )
        if state["checks_left"]:
            state["checks_left"] -= 1
            if text != slow(msgs, generation):
                state["fast"] = False
                return slow(msgs, generation)
        return text

    return fast


def segments(tokenizer: Any, template: str, conv: Conversation) -> list[tuple[str, bool]]:
    """`segments_with` rendering by apply_chat_template, call by call."""
    return segments_with(lambda msgs, gen: _render(tokenizer, template, msgs, gen), conv)


def segments_with(render: Render, conv: Conversation) -> list[tuple[str, bool]]:
    """The rendered conversation as (text, trained) pieces; trained = an assistant turn.

    Each assistant turn's text is what rendering it adds after the prompt that
    asks for it (the conversation so far with add_generation_prompt). A
    template whose renderings are not prefixes of each other (some drop past
    reasoning) trains on the last answer only.
    """
    pieces: list[tuple[str, bool]] = []
    done = ""
    ok = True
    for i, m in enumerate(conv):
        if m["role"] != "assistant":
            continue
        prompt = render(conv[:i], True)
        full = render(conv[: i + 1], False)
        if not (prompt.startswith(done) and full.startswith(prompt)):
            ok = False
            break
        pieces += [(prompt[len(done) :], False), (full[len(prompt) :], True)]
        done = full
    if ok:
        end = render(conv, False)
        if end.startswith(done):
            pieces.append((end[len(done) :], False))
            return [(t, trained) for t, trained in pieces if t]
    last = max(i for i, m in enumerate(conv) if m["role"] == "assistant")
    prompt = render(conv[:last], True)
    full = render(conv[: last + 1], False)
    k = 0
    while k < min(len(prompt), len(full)) and prompt[k] == full[k]:
        k += 1
    return [(t, trained) for t, trained in ((full[:k], False), (full[k:], True)) if t]


def encode_conversation(
    tokenizer: Any, template: str, conv: Conversation, max_seq_len: int
) -> Encoded:
    """Token ids and labels of one conversation, cut at max_seq_len tokens.

    Each piece is tokenized on its own (no special tokens added: the template
    writes them), so the prompt/answer boundary is exact.
    """
    ids: list[int] = []
    labels: list[int] = []
    for text, trained in segments(tokenizer, template, conv):
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        labels += piece if trained else [IGNORE] * len(piece)
    cut = len(ids) > max_seq_len
    return Encoded(ids[:max_seq_len], labels[:max_seq_len], cut)


#: The most threads a batched tokenizer call uses: the node's cores are shared
#: with the engines beside the trainer, and the burst lasts seconds.
TOKENIZER_THREADS = 8


@contextlib.contextmanager
def _parallel_tokenizing() -> Iterator[None]:
    """The fast tokenizer's own thread pool on for one batched call.

    The agent turns TOKENIZERS_PARALLELISM off for the whole trainer (a
    process that forks after using the pool may deadlock); the trainer never
    forks, so a batched call may use up to TOKENIZER_THREADS cores (the pool's
    size is read once, at its first use).
    """
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ.setdefault("RAYON_NUM_THREADS", str(min(TOKENIZER_THREADS, os.cpu_count() or 1)))
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved


def encode_many(
    tokenizer: Any,
    template: str,
    records: Sequence[tuple[int, Conversation]],
    max_seq_len: int,
    last_answer_only: bool = False,
) -> list[Encoded]:
    """`encode_conversation` of each (line number, record), the same tokens, in
    one pass: the template compiled once, then every record's pieces tokenized
    in one batched call (the fast tokenizer's Rust loop, not a Python call a
    piece). last_answer_only: earlier assistant turns are context (a
    preference pair's prompt), only the last is labelled."""
    render = renderer(tokenizer, template)
    texts: list[str] = []
    trained: list[bool] = []
    counts: list[int] = []
    for lineno, conv in records:
        try:
            pieces = segments_with(render, conv)
        except Exception as e:
            raise BadInputError(
                f"data line {lineno} cannot be rendered with the model's chat template: "
                f"{type(e).__name__}: {e}"
            ) from e
        if last_answer_only:
            last = max((k for k, (_, x) in enumerate(pieces) if x), default=-1)
            pieces = [(t, k == last) for k, (t, _) in enumerate(pieces)]
        texts += [t for t, _ in pieces]
        trained += [x for _, x in pieces]
        counts.append(len(pieces))
    with _parallel_tokenizing():
        ids_of = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    out: list[Encoded] = []
    k = 0
    for n in counts:
        ids: list[int] = []
        labels: list[int] = []
        for piece, is_trained in zip(ids_of[k : k + n], trained[k : k + n], strict=True):
            ids += piece
            labels += piece if is_trained else [IGNORE] * len(piece)
        k += n
        out.append(Encoded(ids[:max_seq_len], labels[:max_seq_len], len(ids) > max_seq_len))
    return out


class Tokens:
    """The records' token ids, made when first asked for, a batch at a time.

    Only what the plan reads is tokenized: with max_steps a few windows of
    the first epoch, not the whole file. `cut` and `skipped` count the records
    tokenized so far (skipped: no answer token left within max_seq_len).
    """

    #: Records a batched call tokenizes at most, so progress shows between calls.
    CHUNK = 4096

    def __init__(
        self,
        tokenizer: Any,
        template: str,
        records: Sequence[tuple[int, Conversation]],
        max_seq_len: int,
        on_progress: Callable[[int], None] = lambda done: None,
        last_answer_only: bool = False,
    ) -> None:
        self._last_answer_only = last_answer_only
        self._tokenizer = tokenizer
        self._template = template
        self._records = records
        self._max_seq_len = max_seq_len
        self.on_progress = on_progress
        self._encoded: dict[int, Encoded] = {}
        self.cut = 0
        self.skipped = 0

    def get(self, indices: Sequence[int]) -> list[Encoded]:
        """The records at `indices` (of the data file's records), tokenizing the missing."""
        missing = sorted({i for i in indices if i not in self._encoded})
        for c in range(0, len(missing), self.CHUNK):
            chunk = missing[c : c + self.CHUNK]
            encoded = encode_many(
                self._tokenizer,
                self._template,
                [self._records[i] for i in chunk],
                self._max_seq_len,
                self._last_answer_only,
            )
            for i, e in zip(chunk, encoded, strict=True):
                self._encoded[i] = e
                self.cut += e.cut
                self.skipped += e.answer_tokens == 0
            self.on_progress(len(self._encoded))
        return [self._encoded[i] for i in indices]

    def lengths(self, indices: Sequence[int]) -> list[int]:
        """Each record's token count, 0 for one with no answer token (skipped)."""
        return [len(e.input_ids) if e.answer_tokens else 0 for e in self.get(indices)]

    @property
    def done(self) -> int:
        return len(self._encoded)

    def length_summary(self) -> dict[str, int]:
        """min, p50, p95, max and mean token count of the records tokenized so far."""
        lengths = sorted(len(e.input_ids) for e in self._encoded.values())
        if not lengths:
            return {}

        def at(q: float) -> int:
            return lengths[min(len(lengths) - 1, int(q * len(lengths)))]

        return {
            "min": lengths[0],
            "p50": at(0.5),
            "p95": at(0.95),
            "max": lengths[-1],
            "mean": round(sum(lengths) / len(lengths)),
        }
