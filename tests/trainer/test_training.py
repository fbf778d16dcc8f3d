"""Real LoRA training of tiny Llama and Qwen2 models by the trainer, on the CPU."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import signal
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from lorafleet_trainer.batches import split_records
from lorafleet_trainer.rendering import encode_conversation
from lorafleet_trainer.run import load_records
from tests.trainer.conftest import TRAIN_PARAMS
from tests.trainer.harness import (
    TrainerRun,
    fake_hf_cache,
    ndjson,
    qa_records,
    run_here,
    run_trainer,
    start_trainer,
    write_job,
)

pytestmark = pytest.mark.slow

ARCHS = ["llama", "qwen2"]
Trained = Callable[[str], tuple[TrainerRun, Path]]


@pytest.mark.parametrize("arch", ARCHS)
def test_training_lowers_the_loss(trained: Trained, arch: str) -> None:
    run, _ = trained(arch)
    steps = run.events("step")
    # 14 training records, batches of 4: 4 steps an epoch.
    assert [s["step"] for s in steps] == list(range(1, 6 * 4 + 1))
    assert {s["steps"] for s in steps} == {24}
    assert [s["epoch"] for s in steps] == [e for e in range(1, 7) for _ in range(4)]
    first, last = steps[0]["loss"], steps[-1]["loss"]
    assert last < 0.5 * first, [round(s["loss"], 3) for s in steps]
    assert all(s["peak_mib"] > 0 and s["tokens_per_s"] > 0 for s in steps)
    # Warm-up from 0 over 2 steps, then a cosine decay.
    lrs = [s["learning_rate"] for s in steps]
    assert lrs[0] == 0.0
    assert lrs[2] == pytest.approx(TRAIN_PARAMS["learning_rate"])
    assert all(a >= b for a, b in itertools.pairwise(lrs[2:]))
    assert steps[-1]["eta_s"] == 0.0
    evals = run.events("eval")
    assert [(e["step"], e["epoch"]) for e in evals] == [(4 * e, e) for e in range(1, 7)]
    assert evals[-1]["eval_loss"] < 0.5 * evals[0]["eval_loss"]
    assert run.states() == ["preparing", "running", "saving"]
    assert run.lines[-1]["event"] == "done"
    # "auto" without a budget: none, and the job's events say so.
    messages = [x["message"] for x in run.events("log")]
    assert any(
        m.startswith(
            "memory plan: no gradient checkpointing, the C library's heap: no memory budget"
        )
        for m in messages
    )


def test_the_token_lengths_are_reported_before_the_weights_load(trained: Trained) -> None:
    run, _ = trained("llama")
    (lengths,) = run.events("lengths")
    kinds = [x["event"] for x in run.lines]
    assert kinds.index("lengths") < kinds.index("step")
    # Without max_steps every training record (14) before the first step.
    assert lengths["records_tokenized"] == 14 and lengths["records_cut"] == 0
    assert 0 < lengths["min"] <= lengths["p50"] <= lengths["p95"] <= lengths["max"] <= 64
    summary = run.events("done")[0]["summary"]
    assert summary["records_tokenized"] == 16  # the held-out two at the first eval
    assert summary["token_lengths"]["max"] >= lengths["max"]


def test_with_max_steps_only_the_records_the_steps_need_are_tokenized(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    records = qa_records(200)  # 1,600 records; 5 steps of 2 read one window of 128
    params = {**TRAIN_PARAMS, "max_steps": 5, "batch_size": 2, "eval_fraction": 0.0}
    run = run_trainer(write_job(tmp_path, tiny_model("llama"), data=ndjson(records), params=params))
    assert run.rc == 0, run.stderr[-3000:]
    (lengths,) = run.events("lengths")
    assert lengths["records_tokenized"] == 2 * 64
    assert len(run.events("step")) == 5
    preparing = [x["message"] for x in run.events("state") if x["state"] == "preparing"]
    assert "tokenizing: 128 of 1600 records" in preparing
    summary = run.events("done")[0]["summary"]
    assert summary["records_tokenized"] == 128 and summary["steps"] == 5


@pytest.mark.parametrize("arch", ARCHS)
def test_done_reports_the_base_dir_and_writes_the_summary(
    trained: Trained, tiny_model: Callable[[str], Path], arch: str
) -> None:
    from transformers import AutoTokenizer

    run, job_path = trained(arch)
    job = json.loads(job_path.read_text())
    (done,) = run.events("done")
    assert Path(done["base_dir"]) == tiny_model(arch)
    adapter = Path(done["adapter_dir"])
    assert adapter == Path(job["out_dir"]) / "adapter"
    for name in ("adapter_model.safetensors", "adapter_config.json", "chat_template.jinja"):
        assert (adapter / name).is_file(), name
    assert (adapter / "chat_template.jinja").read_text() == (
        tiny_model(arch) / "chat_template.jinja"
    ).read_text()
    summary = json.loads((adapter / "training_summary.json").read_text())
    assert summary == done["summary"]
    # The keys lorafleet_trainer.run's docstring lists.
    assert set(summary) == {
        "job_id", "final_loss", "eval_loss", "params", "base", "data_sha256", "eval_data_sha256",
        "records",
        "records_train", "records_eval", "records_cut", "records_skipped", "records_tokenized",
        "token_lengths", "padding_tokens", "chat_template",
        "steps", "epochs", "tokens_seen", "train_time_s", "wall_time_s", "peak_mib", "device",
        "dtype", "memory", "trainable_parameters", "versions", "resumed_from", "checkpoints",
        "preference_eval",
    }  # fmt: skip
    assert summary["preference_eval"] is None  # a supervised job's
    assert summary["memory"] == {
        "budget_mib": None, "estimate_mib": summary["memory"]["estimate_mib"],
        "plan": "no gradient checkpointing, the C library's heap",
        "final_plan": {"every": 0, "frugal_heap": False, "micro_rows": 0}, "tightened": 0,
    }  # fmt: skip
    assert summary["chat_template"] == "tokenizer" and summary["steps"] == 24
    assert summary["resumed_from"] is None and summary["checkpoints"] == 0
    assert summary["final_loss"] == run.events("step")[-1]["loss"]
    assert summary["eval_loss"] == run.events("eval")[-1]["eval_loss"]
    assert summary["data_sha256"] == job["data_sha256"] and summary["eval_data_sha256"] is None
    assert summary["base"]["local_dir"] == str(tiny_model(arch))
    assert summary["records"] == 16
    assert (summary["records_train"], summary["records_eval"]) == (14, 2)
    assert summary["records_cut"] == 0
    assert summary["params"]["rank"] == TRAIN_PARAMS["rank"]
    assert summary["device"] == "cpu" and summary["dtype"] == "fp32"
    # Every training record once an epoch, padding not counted.
    records = [c for _, c in load_records(Path(job["data_path"]), job["data_sha256"])]
    train_idx, _ = split_records(16, 0.125, TRAIN_PARAMS["seed"])
    tok = AutoTokenizer.from_pretrained(done["base_dir"])
    template = (adapter / "chat_template.jinja").read_text()
    lengths = [len(encode_conversation(tok, template, records[i], 64).input_ids) for i in train_idx]
    assert summary["tokens_seen"] == 6 * sum(lengths)
    assert summary["wall_time_s"] >= summary["train_time_s"] > 0
    assert set(summary["versions"]) >= {"torch", "transformers", "peft"}
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == TRAIN_PARAMS["rank"] and config["peft_type"] == "LORA"


def _reload(run: TrainerRun, job_path: Path) -> tuple[Any, list[Any], Any]:
    """The base with the saved adapter, and the held-out records encoded as trained."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    job = json.loads(job_path.read_text())
    (done,) = run.events("done")
    records = [c for _, c in load_records(Path(job["data_path"]), job["data_sha256"])]
    _, eval_idx = split_records(len(records), TRAIN_PARAMS["eval_fraction"], TRAIN_PARAMS["seed"])
    tok = AutoTokenizer.from_pretrained(done["base_dir"])
    template = (Path(done["adapter_dir"]) / "chat_template.jinja").read_text()
    held = [
        encode_conversation(tok, template, records[i], TRAIN_PARAMS["max_seq_len"])
        for i in eval_idx
    ]
    base = AutoModelForCausalLM.from_pretrained(done["base_dir"], dtype=torch.float32)
    with warnings.catch_warnings():
        # peft 0.21 still calls transformers' deprecated is_gradient_checkpointing.
        warnings.simplefilter("ignore", FutureWarning)
        model = PeftModel.from_pretrained(base, done["adapter_dir"])
    model.eval()
    return model, held, torch


def _loss_and_logits(model: Any, held: list[Any], torch: Any) -> tuple[float, list[Any]]:
    import torch.nn.functional as F

    total, count, logits = 0.0, 0, []
    with torch.no_grad():
        for e in held:
            out = model(input_ids=torch.tensor([e.input_ids])).logits[0]
            labels = torch.tensor(e.labels[1:])
            total += float(F.cross_entropy(out[:-1], labels, ignore_index=-100, reduction="sum"))
            count += int((labels != -100).sum())
            logits.append(out)
    return total / count, logits


@pytest.mark.parametrize("arch", ARCHS)
def test_the_reloaded_adapter_reproduces_the_eval_loss_and_changes_outputs(
    trained: Trained, arch: str
) -> None:
    run, job_path = trained(arch)
    model, held, torch = _reload(run, job_path)
    assert len(held) == 2
    adapted_loss, adapted = _loss_and_logits(model, held, torch)
    reported = run.events("eval")[-1]["eval_loss"]
    assert adapted_loss == pytest.approx(reported, rel=1e-4)
    with model.disable_adapter():
        base_loss, base = _loss_and_logits(model, held, torch)
    assert base_loss > adapted_loss + 1.0, (base_loss, adapted_loss)
    diff = max(float((a - b).abs().max()) for a, b in zip(adapted, base, strict=True))
    assert diff > 1.0


#: Questions the training records never ask: an evaluation set disjoint from them.
UNSEEN = [
    {"q": "What colour is grass?", "a": "Grass is green in the summer."},
    {"q": "How many legs does a bird have?", "a": "A bird has two legs."},
    {"q": "What do cows make?", "a": "Cows make milk."},
]


def test_an_evaluation_set_is_what_the_eval_loss_is_computed_on(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    """With eval_data the trainer trains on every record (no share held out)
    and evaluates on the set: the reported eval loss is the reloaded
    adapter's loss on those records, computed here by hand. Held out of the
    training data instead, the eval records would be repeats of trained
    ones (qa_records repeats each), at a far lower loss."""
    eval_text = ndjson(UNSEEN)
    eval_path = tmp_path / "eval.jsonl"
    eval_path.write_text(eval_text, encoding="utf-8")
    eval_sha = hashlib.sha256(eval_text.encode()).hexdigest()
    params = {**TRAIN_PARAMS, "epochs": 2}
    job_path = write_job(tmp_path, tiny_model("llama"), data=ndjson(qa_records()), params=params,
                         eval_data_path=str(eval_path), eval_data_sha256=eval_sha)  # fmt: skip
    trainer = run_here(job_path)  # a subprocess's imports cost more than the training
    assert trainer.rc == 0, trainer.raw_lines
    summary = trainer.events("done")[0]["summary"]
    # Every one of the 16 records trained on: 4 steps an epoch (14 would be 4 too).
    assert (summary["records"], summary["records_train"], summary["records_eval"]) == (16, 16, 3)
    assert summary["eval_data_sha256"] == eval_sha
    assert summary["tokens_seen"] > 0 and summary["steps"] == 8
    messages = [x["message"] for x in trainer.events("log")]
    assert any("3 in the evaluation set" in m and "eval_fraction 0.125 is unused" in m
               for m in messages), messages  # fmt: skip
    evals = trainer.events("eval")
    assert [e["step"] for e in evals] == [4, 8]

    from transformers import AutoTokenizer

    (done,) = trainer.events("done")
    model, _, torch = _reload(trainer, job_path)
    tok = AutoTokenizer.from_pretrained(done["base_dir"])
    template = (Path(done["adapter_dir"]) / "chat_template.jinja").read_text()
    encoded = [encode_conversation(tok, template, c, 64)
               for _, c in load_records(eval_path, eval_sha)]  # fmt: skip
    by_hand, _ = _loss_and_logits(model, encoded, torch)
    assert evals[-1]["eval_loss"] == pytest.approx(by_hand, rel=1e-4)
    job = json.loads(job_path.read_text())
    trained_on = load_records(Path(job["data_path"]), job["data_sha256"])[:4]
    repeats, _ = _loss_and_logits(
        model, [encode_conversation(tok, template, c, 64) for _, c in trained_on], torch
    )
    assert by_hand > repeats + 0.5, (by_hand, repeats)


def test_messages_records_accumulation_max_steps_and_no_eval(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    """max_steps wins over epochs, steps count optimizer steps (not micro-batches),
    eval_fraction 0 prints no eval line, gradient checkpointing trains."""
    convs = [
        {
            "messages": [
                {"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": q},
                {"role": "assistant", "content": a},
            ]
        }
        for q, a in [(r["q"], r["a"]) for r in qa_records(1)]
    ]
    job = write_job(
        tmp_path / "j",
        tiny_model("llama"),
        data=ndjson(convs),
        params={
            "max_steps": 3,
            "epochs": 50,
            "batch_size": 2,
            "gradient_accumulation": 3,
            "eval_fraction": 0,
            "gradient_checkpointing": True,
            "target_modules": ["q_proj", "v_proj"],
            "lr_scheduler": "constant",
            "max_seq_len": 36,
            # The card path: a bf16 base, fp32 adapter weights, autocast.
            "dtype": "bf16",
        },
    )
    run = run_trainer(job)
    assert run.rc == 0, run.stderr[-3000:]
    steps = run.events("step")
    assert [(s["step"], s["steps"]) for s in steps] == [(1, 3), (2, 3), (3, 3)]
    # 8 records, 2 a micro-batch, 3 micro-batches a step: 2 steps an epoch.
    assert [s["epoch"] for s in steps] == [1, 1, 2]
    assert run.events("eval") == []
    (done,) = run.events("done")
    summary = done["summary"]
    assert summary["eval_loss"] is None and summary["records_eval"] == 0
    assert summary["dtype"] == "bf16"
    assert all(math.isfinite(s["loss"]) and s["loss"] > 0 for s in steps)
    assert summary["records_cut"] == 8  # 41 to 48 tokens each, the answer starting by token 35
    assert summary["records_skipped"] == 0
    cut_logs = [x for x in run.events("log") if "were cut" in x["message"]]
    assert cut_logs and cut_logs[0]["level"] == "warning"
    messages = [x["message"] for x in run.events("log")]
    assert any(
        m.startswith(
            "memory plan: gradient checkpointing every layer, the C library's heap: "
            "params.gradient_checkpointing is true; no memory budget; the estimate is "
        )
        for m in messages
    )
    # No budget: glibc's heap, the fastest (the frugal one is a plan a budget chooses).
    assert not any(m.startswith("host heap:") for m in messages)
    config = json.loads((Path(done["adapter_dir"]) / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == ["q_proj", "v_proj"]


def test_a_base_from_the_hugging_face_cache(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    hf_home = tmp_path / "hf"
    snapshot = fake_hf_cache(hf_home, "lorafleet/tiny-qwen2", tiny_model("qwen2"), "v1")
    base = {"hf_repo": "lorafleet/tiny-qwen2", "hf_revision": "v1", "local_dir": None}
    job = write_job(
        tmp_path / "j",
        tiny_model("qwen2"),
        data=ndjson(qa_records(1)),
        params={"max_steps": 2, "eval_fraction": 0},
        base=base,
    )
    run = run_trainer(job, env={"HF_HOME": str(hf_home)})
    assert run.rc == 0, run.stderr[-3000:]
    (done,) = run.events("done")
    assert done["base_dir"] == str(snapshot)
    assert done["summary"]["base"] == {
        "hf_repo": "lorafleet/tiny-qwen2",
        "hf_revision": "v1",
        "local_dir": None,
        "base_dir": str(snapshot),
    }
    config = json.loads((Path(done["adapter_dir"]) / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "lorafleet/tiny-qwen2"

    # A revision the cache does not hold: a failure of the node, not of the job's input.
    other = write_job(
        tmp_path / "k",
        tiny_model("qwen2"),
        data=ndjson(qa_records(1)),
        base={**base, "hf_revision": "v2"},
    )
    run = run_trainer(other, env={"HF_HOME": str(hf_home)})
    assert run.rc == 3  # another node's cache may hold it: the job may be retried there
    assert run.lines[-1]["event"] == "error"
    assert run.lines[-1]["message"].startswith(
        "lorafleet/tiny-qwen2@v2 is not in the node's Hugging Face cache: "
    )


def test_sigterm_stops_training_promptly(tiny_model: Callable[[str], Path], tmp_path: Path) -> None:
    job = write_job(
        tmp_path / "j",
        tiny_model("qwen2"),
        data=ndjson(qa_records()),
        params={"max_steps": 100_000, "batch_size": 2},
    )
    with start_trainer(job) as p:
        try:
            assert p.stdout is not None
            seen = []
            for line in p.stdout:
                seen.append(json.loads(line))
                if seen[-1]["event"] == "step":
                    break
            assert seen[-1]["event"] == "step", seen
            os.kill(p.pid, signal.SIGTERM)
            rest = [json.loads(x) for x in p.stdout]
            assert p.wait(timeout=30) == 143
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert rest[-1] == {"event": "error", "message": "stopped by SIGTERM"}
    assert not (tmp_path / "j" / "out" / "adapter").exists()


def test_the_same_job_trains_the_same_way(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    """Seeded: two runs of one job (in this process, to spare the imports) print
    the same losses, and another seed does not."""

    def losses(name: str, seed: int) -> list[float]:
        job = write_job(
            tmp_path / name,
            tiny_model("llama"),
            data=ndjson(qa_records()),
            params={"max_steps": 3, "batch_size": 4, "learning_rate": 0.01, "seed": seed},
        )
        done = run_here(job)
        assert done.rc == 0
        return [x["loss"] for x in done.events("step")] + [
            x["eval_loss"] for x in done.events("eval")
        ]

    first = losses("a", 1)
    assert len(first) == 4
    assert losses("b", 1) == first
    assert losses("c", 2) != first


def test_a_budget_below_the_estimate_takes_the_cheapest_plan_and_trains_the_same(
    tmp_path: Path,
) -> None:
    import re

    from lorafleet_services.local.tiny_model import build_tiny_model

    # 8 layers of 128 and rows of about 200 tokens: the plans' estimates
    # differ by more than the estimate's error (10%), which a budget keeps
    # over a plan's estimate; the process's own 400 MiB is the most of each.
    sizes = {"hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 8}
    base = build_tiny_model("llama", tmp_path / "wide", sizes=sizes)
    records = [{"q": r["q"], "a": " ".join([r["a"]] * 24)} for r in qa_records()]
    # No dropout: forward passes of fewer rows would draw other masks.
    params = {**TRAIN_PARAMS, "epochs": 1, "eval_fraction": 0.25, "max_seq_len": 512}
    params["dropout"] = 0.0
    runs: dict[str, TrainerRun] = {}
    chose: dict[str, str] = {}
    budget = None
    for name in ("none", "below"):
        job = write_job(
            tmp_path / name, base, data=ndjson(records), params=params, gpu_memory_mib=budget
        )
        # Each in a process of its own: a process counts its own memory in
        # the estimate, and this one would hold the first run's leftovers.
        runs[name] = run_trainer(job)
        assert runs[name].rc == 0, runs[name].lines[-20:]
        (chose[name],) = [
            x["message"]
            for x in runs[name].events("log")
            if x["message"].startswith("memory plan:")
        ]
        if budget is None:
            # Just below the estimate of the default plan (of the records' longest row).
            m = re.fullmatch(
                r"memory plan: no gradient checkpointing, the C library's heap: no memory "
                r"budget; the estimate is (\d+) MiB",
                chose[name],
            )
            assert m, chose[name]
            budget = int(m.group(1)) - 1
    assert re.fullmatch(
        rf"memory plan: .*: the cheapest that fits the budget of {budget} MiB: its estimate is "
        rf"\d+ MiB \(\d+ MiB with its error of 10%; without any of it \d+ MiB\), its steps "
        r"about \d+% slower",
        chose["below"],
    ), chose["below"]
    final = runs["below"].events("done")[0]["summary"]["memory"]["final_plan"]
    assert final != {"every": 0, "frugal_heap": False, "micro_rows": 0}
    # Neither recomputing a layer nor forward passes of fewer rows changes a
    # number (beyond the order of a float sum).
    losses = {k: [s["loss"] for s in r.events("step")] for k, r in runs.items()}
    assert losses["below"] == pytest.approx(losses["none"], rel=1e-5)
    evals = {k: r.events("eval")[-1]["eval_loss"] for k, r in runs.items()}
    assert evals["below"] == pytest.approx(evals["none"], rel=1e-5)
