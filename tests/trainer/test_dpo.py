"""DPO with the real trainer on a tiny model, on the CPU: the reference is
the model with its adapter disabled (computed here by hand and compared),
training raises the held-out pairs' log-likelihood margin and preference
accuracy above the start, and a run resumed from a checkpoint ends with the
uninterrupted run's losses."""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from lorafleet_trainer.batches import to_batch
from lorafleet_trainer.loop import prepare_training
from lorafleet_trainer.memory import architecture_from_config, estimate_lines
from lorafleet_trainer.params import Params
from lorafleet_trainer.preference import (
    PairTokens,
    pair_numbers,
    pair_parts,
    pair_rows,
    reference_logps,
    sequence_logps,
)
from lorafleet_trainer.records import Preference
from lorafleet_trainer.rendering import chat_template_of
from tests.trainer.harness import QA, TrainerRun, ndjson, run_here, write_job
from tests.trainer.test_protocol import _decode_strictly

pytestmark = pytest.mark.slow

#: Pair i: the question's answer over the next question's. The evaluation
#: set pairs each answer against another wrong one (three on), not trained on.
TRAIN = [{"prompt": q, "chosen": a, "rejected": QA[(i + 1) % len(QA)][1]}
         for i, (q, a) in enumerate(QA)]  # fmt: skip
HELD = [{"prompt": q, "chosen": a, "rejected": QA[(i + 3) % len(QA)][1]}
        for i, (q, a) in enumerate(QA)]  # fmt: skip
#: 2 steps an epoch; dropout on, so a resume that lost the RNG states differs.
PARAMS: dict[str, Any] = {
    "method": "dpo", "beta": 0.1, "rank": 8, "alpha": 16, "dropout": 0.1,
    "learning_rate": 0.005, "lr_scheduler": "cosine", "max_steps": 6, "batch_size": 4,
    "max_seq_len": 64, "seed": 7, "checkpoint_every_steps": 3, "checkpoint_every_s": 0,
}  # fmt: skip


def _job(job_dir: Path, base: Path, **overrides: Any) -> Path:
    held = ndjson(HELD)
    held_path = job_dir / "held.jsonl"
    job_dir.mkdir(parents=True, exist_ok=True)
    held_path.write_text(held)
    overrides.setdefault("checkpoint_dir", str(job_dir / "checkpoints"))
    return write_job(
        job_dir, base, data=ndjson(TRAIN), params=PARAMS,
        eval_data_path=str(held_path), eval_data_sha256=hashlib.sha256(held.encode()).hexdigest(),
        **overrides,
    )  # fmt: skip


@pytest.fixture(scope="module")
def uninterrupted(
    tiny_model: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[TrainerRun, Path]:
    job_dir = tmp_path_factory.mktemp("dpo")
    run = run_here(_job(job_dir, tiny_model("llama")))
    assert run.rc == 0
    return run, job_dir


def _loop(base: Path, adapter: Path | None = None) -> tuple[Any, PairTokens]:
    """The base with a LoRA (the trained `adapter`'s weights, else B drawn at
    random so that the adapter changes the output), and its pair tokens."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_pretrained(str(base))
    p = Params(**{k: v for k, v in PARAMS.items() if k != "checkpoint_every_s"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # peft on transformers' renames
        loop = prepare_training(model, p, "fp32", torch.device("cpu"), 1)
    if adapter is None:
        for name, w in loop.model.named_parameters():
            if "lora_B" in name:
                w.data.normal_(0, 0.5)
    else:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        set_peft_model_state_dict(loop.model, load_file(str(adapter / "adapter_model.safetensors")))
    loop.model.eval()
    tok = AutoTokenizer.from_pretrained(str(base))
    pairs = [(n, Preference([{"role": "user", "content": r["prompt"]}], r["chosen"], r["rejected"]))
             for n, r in enumerate(HELD, 1)]  # fmt: skip
    tokens = PairTokens(tok, chat_template_of(tok), pair_rows(pairs), 64, last_answer_only=True)
    return loop, tokens


def _by_hand(model: Any, batch: Any) -> Any:
    """Each row's summed log-probability of its labelled tokens, from the
    whole logits (no chunks, no fused head)."""
    import torch

    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logp = torch.log_softmax(logits[:, :-1].float(), -1)
    labels = batch.labels[:, 1:]
    mask = labels != -100
    picked = logp.gather(2, labels.clamp(min=0)[..., None])[..., 0]
    return (picked * mask).sum(1)


def test_the_reference_is_the_model_with_its_adapter_disabled(
    tiny_model: Callable[[str], Path],
) -> None:
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    base = tiny_model("llama")
    loop, tokens = _loop(base)
    batch = to_batch(tokens.get([0, 1, 2]), 0, torch.device("cpu"))
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(str(base)).eval()
        ref_by_hand = _by_hand(plain, batch)  # a second copy here only, to compare
        policy_by_hand = _by_hand(loop.model, batch)
        ref = reference_logps(loop, batch)
        policy = sequence_logps(loop.model, batch)
        losses, chosen, rejected = pair_numbers(loop, batch, 0.1)
        # Forward passes of one pair each (a tight memory plan): the same rows.
        parts = [sequence_logps(loop.model, part) for part in pair_parts(batch, 1)]
    assert ref.shape == (6,) and torch.allclose(ref, ref_by_hand, atol=1e-4), (ref, ref_by_hand)
    assert torch.allclose(policy, policy_by_hand, atol=1e-4)
    assert (policy - ref).abs().max() > 0.1  # the adapter is on outside the reference
    assert torch.allclose(chosen, 0.1 * (policy_by_hand[:3] - ref_by_hand[:3]), atol=1e-4)
    assert torch.allclose(rejected, 0.1 * (policy_by_hand[3:] - ref_by_hand[3:]), atol=1e-4)
    assert torch.allclose(losses, -F.logsigmoid(chosen - rejected), atol=1e-6)
    assert len(parts) == 3
    by_part = torch.cat([x[:1] for x in parts] + [x[1:] for x in parts])
    assert torch.allclose(by_part, policy, atol=1e-4)


def test_training_raises_the_held_out_margin_and_accuracy(
    uninterrupted: tuple[TrainerRun, Path], tiny_model: Callable[[str], Path]
) -> None:
    """On the evaluation set (pairs not trained on), the chosen answers'
    log-likelihood margin over the rejected grows and the share of pairs
    preferred beats the start's (the base: a fresh adapter adds nothing)."""
    import torch

    run, job_dir = uninterrupted
    loop, tokens = _loop(tiny_model("llama"), job_dir / "out" / "adapter")
    batch = to_batch(tokens.get(range(len(HELD))), 0, torch.device("cpu"))
    with torch.no_grad():
        start, trained = reference_logps(loop, batch), sequence_logps(loop.model, batch)
    n = len(HELD)
    start_margin, trained_margin = start[:n] - start[n:], trained[:n] - trained[n:]
    assert trained_margin.mean() > start_margin.mean() + 0.5, (start_margin, trained_margin)
    assert (trained_margin > 0).float().mean() > (start_margin > 0).float().mean()
    evals = run.events("eval")
    assert evals[-1]["eval_accuracy"] > 0.5 and evals[-1]["eval_margin"] > 0
    step = run.events("step")[-1]
    assert {"rewards_chosen", "rewards_rejected", "margin", "accuracy"} <= set(step)
    _decode_strictly(run)  # the DPO fields are the schemas' TrainerStep's and TrainerEval's
    summary = run.events("done")[0]["summary"]
    assert summary["preference_eval"] == {
        k: v for k, v in evals[-1].items() if k.startswith("eval")
    }


def test_a_resumed_dpo_run_ends_as_the_uninterrupted_one(
    uninterrupted: tuple[TrainerRun, Path], tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    run, job_dir = uninterrupted
    assert [c["step"] for c in run.events("checkpoint")] == [3]
    resumed = run_here(
        _job(tmp_path / "resumed", tiny_model("llama"),
             resume={"dir": str(job_dir / "checkpoints" / "step-00000003"), "mode": "continue"})
    )  # fmt: skip
    assert resumed.rc == 0

    def losses(r: TrainerRun, after: int) -> list[tuple[int, float, float]]:
        return [(s["step"], s["loss"], s["margin"]) for s in r.events("step") if s["step"] > after]

    assert resumed.events("step")[0]["step"] == 4
    assert losses(resumed, 3) == losses(run, 3)
    assert resumed.events("eval")[-1] == run.events("eval")[-1]


def test_the_estimate_counts_two_rows_a_pair_and_names_the_reference_pass(
    tiny_model: Callable[[str], Path],
) -> None:
    arch = architecture_from_config(json.loads((tiny_model("llama") / "config.json").read_text()))
    sft = dict((n, b) for n, b, _ in estimate_lines(arch, Params(), "cpu", 64, 0))
    dpo = dict((n, b) for n, b, _ in estimate_lines(arch, Params(method="dpo"), "cpu", 64, 0))
    double = dict((n, b) for n, b, _ in estimate_lines(arch, Params(batch_size=8), "cpu", 64, 0))
    assert dpo["activations"] == double["activations"] > sft["activations"]
    assert "reference pass" in dpo and "reference pass" not in sft
