"""The demo's adapter learns what a person can see: asked one of its trained
questions, it answers the trained answer, where the base model says noise —
found when `demo --serve` ended with two gibberish answers side by side (96
sums, 4 epochs at 3e-3: the adapter learnt nothing visible)."""

from __future__ import annotations

import io
import warnings
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console

from lorafleet_services.demo import DEMO_PAIRS, SERVED_MODEL, demo_job, tiny_model
from lorafleet_trainer.layout import ADAPTER_DIR
from tests.trainer.harness import run_trainer, write_job

#: Tokens generated per answer: more than the longest trained answer has.
ANSWER_TOKENS = 32


def test_the_demo_adapter_answers_its_trained_questions_and_the_base_does_not(
    tmp_path: Path,
) -> None:
    # The demo's own model (as --serve builds it for the CPU vLLM), job and data,
    # through the trainer program the agent starts.
    base = tiny_model(tmp_path, Console(file=io.StringIO()), SERVED_MODEL)
    job = demo_job(SERVED_MODEL, serve=True)
    assert job.params is not None and isinstance(job.data, str)
    path = write_job(
        tmp_path / "job", base, data=job.data,
        params=msgspec.to_builtins(job.params), gpu_memory_mib=job.gpu_memory_mib,
    )  # fmt: skip
    run = run_trainer(path)
    assert run.rc == 0, run.stderr[-3000:]

    adapter, no_adapter = answers(base, tmp_path / "job" / "out" / ADAPTER_DIR)
    for (question, answer), tuned, plain in zip(DEMO_PAIRS, adapter, no_adapter, strict=True):
        assert tuned == answer, (question, tuned)
        assert plain != answer, (question, plain)


def answers(base: Path, adapter_dir: Path) -> tuple[list[str], list[str]]:
    """Greedy chat replies to each of DEMO_PAIRS' questions, rendered as vLLM's
    chat endpoint renders them (the model's chat template): (with the adapter, without)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok: Any = AutoTokenizer.from_pretrained(base)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # peft on transformers' renames
        model: Any = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter_dir
        ).eval()

    def reply(question: str) -> str:
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        ids = tok(prompt, add_special_tokens=False, return_tensors="pt").input_ids
        out = model.generate(
            ids, max_new_tokens=ANSWER_TOKENS, do_sample=False,
            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        )  # fmt: skip
        return str(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)).strip()

    with torch.no_grad():
        tuned = [reply(q) for q, _ in DEMO_PAIRS]
        with model.disable_adapter():
            plain = [reply(q) for q, _ in DEMO_PAIRS]
    return tuned, plain
