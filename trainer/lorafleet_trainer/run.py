"""The job: the data read and tokenized, the base loaded, the training run,
the adapter and its summary saved.

It writes <out_dir>/adapter/: the peft adapter, chat_template.jinja,
training_summary.json (`describe_inputs`, `describe_training` and the
run's versions, resume, checkpoints and memory plan (lorafleet_trainer.guard);
also the "done" line's summary) and, when trained in fp32, probe.json
(lorafleet_trainer.probe).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from lorafleet_trainer.base_model import (
    check_target_modules,
    choose_memory_plan,
    library_versions,
    load_for_training,
    resolve_base,
)
from lorafleet_trainer.batches import plan_grouped, split_records
from lorafleet_trainer.budget import (
    PeakMeter,
    cap_card_memory,
    frugal_host_heap,
    process_rss_mib,
    trim_host_heap,
)
from lorafleet_trainer.checkpoints import Checkpointer, fingerprint_of, open_checkpoint_dir
from lorafleet_trainer.guard import MemoryGuard, Sizing
from lorafleet_trainer.jobfile import JobFile
from lorafleet_trainer.layout import ADAPTER_DIR, CHAT_TEMPLATE, TRAINING_SUMMARY
from lorafleet_trainer.loop import (
    NO_ANSWER,
    Loop,
    Progress,
    enable_checkpointing,
    peak_mib,
    plan_total_steps,
    resolve_dtype,
    train_epochs,
)
from lorafleet_trainer.memory import CUDA_CONTEXT_MIB, PROCESS_MIB, Plan, budget_for
from lorafleet_trainer.params import Params
from lorafleet_trainer.plans import MemoryPlan
from lorafleet_trainer.preference import Dpo, PairTokens, pair_rows
from lorafleet_trainer.probe import write_probe
from lorafleet_trainer.protocol import (
    BadInputError,
    EnvironmentFailureError,
    Event,
    ExitCode,
    LineWriter,
    PauseGate,
)
from lorafleet_trainer.records import (
    PREFERENCE,
    Preference,
    Record,
    RecordError,
    file_sha256,
    read_lines,
)
from lorafleet_trainer.rendering import PLAIN_TEMPLATE, Tokens, chat_template_of
from lorafleet_trainer.resume import apply_resume, check_resume, describe_resume, restore_rng


def load_records(
    path: Path, want_sha256: str, what: str = "data", kind: str = "supervised"
) -> list[tuple[int, Record]]:
    """(line number, record of `kind`, the job's method) of each non-blank
    line of the data file, after checking its sha256 against the job's;
    `what` names the file in errors."""
    if not path.is_file():
        raise BadInputError(f"the {what} file {path} does not exist")
    got = file_sha256(path)
    if got != want_sha256:
        raise BadInputError(f"the {what}'s sha256 is {got}, the job's is {want_sha256}")
    try:
        records = read_lines(path, kind)
    except RecordError as e:
        raise BadInputError(f"{what} {e}") from None
    if not records:
        raise BadInputError(f"the {what} file {path} holds no records")
    return records


def load_data(
    job: JobFile, lines: LineWriter
) -> tuple[list[tuple[int, Record]], tuple[list[int], list[int]]]:
    """The records and their (train, eval) indices. With an evaluation set,
    every record of the data is trained on and the set's records, appended,
    are evaluated on; without, params.eval_fraction of the data is held out."""
    p = job.params
    records = load_records(job.data_path, job.data_sha256, kind=p.method)
    if job.eval_data_path is None or job.eval_data_sha256 is None:
        split = split_records(len(records), p.eval_fraction, p.seed)
        lines.log(f"{len(records)} records: {len(split[0])} to train on, {len(split[1])} held out")
        return records, split
    held = load_records(job.eval_data_path, job.eval_data_sha256, "eval data", p.method)
    n = len(records)
    lines.log(
        f"{n} records, all to train on; {len(held)} in the evaluation set (eval_data), "
        f"so params.eval_fraction {p.eval_fraction:g} is unused"
    )
    return records + held, (list(range(n)), list(range(n, n + len(held))))


def preparing_progress(total: int, lines: LineWriter) -> Callable[[int], None]:
    """The progress of tokenizing, as "preparing" state lines (the agent shows them)."""

    def report(done: int) -> None:
        lines.emit(Event.STATE, state="preparing", message=f"tokenizing: {done} of {total} records")

    return report


def log_cuts(tokens: Tokens, max_seq_len: int, lines: LineWriter) -> None:
    """Warn of the records cut or skipped among those tokenized so far."""
    if tokens.cut:
        lines.log(
            f"{tokens.cut} of {tokens.done} records were longer than max_seq_len {max_seq_len} "
            "tokens and were cut",
            "warning",
        )
    if tokens.skipped:
        lines.log(
            f"{tokens.skipped} records have no answer token within max_seq_len {max_seq_len}; "
            "they are skipped",
            "warning",
        )


def run(job: JobFile, lines: LineWriter) -> int:
    """The whole job, its lines written by `lines`; answers the exit status
    (a failure raises the exception of its exit code)."""
    started = time.time()
    p = job.params
    if job.device == "cpu":
        resolve_dtype(p.dtype, "cpu")  # fp16 is refused before anything loads
    versions = library_versions()
    lines.log("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    records, split = load_data(job, lines)

    if job.hf_offline:
        os.environ["HF_HUB_OFFLINE"] = "1"  # read when huggingface_hub is imported
    lines.emit(Event.STATE, state="preparing", message="loading the tokenizer and the base weights")
    base_dir = resolve_base(job.base, job.hf_offline)
    device, dtype = start_torch(job, lines)
    inputs = prepare_inputs(base_dir, records, split, p, lines)
    total_steps = inputs.total_steps
    check_target_modules(base_dir, p.target_modules)
    resume = check_resume(job, total_steps)  # before the weights load: it fails in seconds
    if job.checkpoint_dir is not None:
        open_checkpoint_dir(job.checkpoint_dir)
    plan, sizing = plan_memory(job, inputs, base_dir, device, lines)
    loop = load_for_training(job, base_dir, dtype, device, total_steps, plan.every)
    guard_memory(loop, job, plan, sizing, lines)
    loop.gate = None if job.pause_path is None else PauseGate(job.pause_path, lines)
    loop.objective = Dpo(p.beta, inputs.pad_id) if p.method == PREFERENCE else None
    n_trainable = sum(x.numel() for x in loop.model.parameters() if x.requires_grad)
    lines.log(
        f"training {n_trainable} LoRA parameters for {total_steps} steps on {device} in {dtype}"
    )
    start, rng = apply_resume(loop, job, resume, total_steps, lines)
    checkpointer = make_checkpointer(job, total_steps, lines)

    done_steps = start.progress.step  # training moves start.progress on
    lines.emit(Event.STATE, state="running", message=running_message(done_steps, total_steps))
    if rng is not None:  # last: nothing may draw from them before the next step
        restore_rng(rng, device)
    progress, epochs = train_epochs(
        loop, inputs.tokens, inputs.split, p, total_steps, inputs.pad_id, lines, start,
        None if checkpointer is None else checkpointer.after_step,
    )  # fmt: skip
    if checkpointer is not None:
        checkpointer.close()

    adapter_dir = job.out_dir / ADAPTER_DIR
    save_results(loop.model, adapter_dir, base_dir, inputs.template, dtype, lines)
    summary = {
        **describe_inputs(job, inputs, base_dir),
        **describe_training(progress, epochs, loop, dtype, started),
        "memory": describe_memory(job, plan, loop),
        "trainable_parameters": n_trainable,
        "versions": versions,
        "resumed_from": describe_resume(job, resume, done_steps),
        "checkpoints": 0 if checkpointer is None else checkpointer.writer.written,
    }
    (adapter_dir / TRAINING_SUMMARY).write_text(json.dumps(summary, indent=2) + "\n", "utf-8")
    lines.emit(Event.DONE, adapter_dir=str(adapter_dir), base_dir=str(base_dir), summary=summary)
    return ExitCode.DONE


def save_results(
    model: Any, adapter_dir: Path, base_dir: Path, template: str, dtype: str, lines: LineWriter
) -> None:
    """The adapter, and the serving agent's probe reference while the trained
    model is loaded: it saves serving a second process that loads base and
    adapter (seconds)."""
    lines.emit(Event.STATE, state="saving", message="saving the adapter")
    save_adapter(model, adapter_dir, template)
    skipped = write_probe(model, base_dir, adapter_dir, dtype)
    if skipped is not None:
        lines.log(skipped)


#: The process's own memory, measured at each start (libraries, tokenizer,
#: records), differs by a MiB or two from one start to the next: the budget
#: a refusal names leaves this much over this run's least, so that the next
#: run, given it, takes it.
START_NOISE_MIB = 8


def plan_memory(
    job: JobFile, inputs: Inputs, base_dir: Path, device: Any, lines: LineWriter
) -> tuple[MemoryPlan, Sizing | None]:
    """The memory plan chosen, logged with why; BadInputError naming the
    smallest budget when none fits the job's. Rows are as wide as the
    longest training record: known when every one was tokenized to plan the
    steps (no max_steps), else max_seq_len. On the CPU the process counts
    itself as it is now: libraries, tokenizer and records, before any weight."""
    p = job.params
    longest = inputs.tokens.length_summary()["max"] if p.max_steps == 0 else p.max_seq_len
    import peft  # noqa: F401  (100 MiB of it, imported for the training anyway)

    own = process_rss_mib() if device.type == "cpu" else None
    choice, sizing = choose_memory_plan(job, base_dir, device, longest, own or PROCESS_MIB)
    lines.log(f"memory plan: {choice.message}")
    if not choice.fits:
        need = budget_for(choice.total_mib)
        raise BadInputError(
            f"the job's memory budget of {job.gpu_memory_mib} MiB (gpu_memory_mib) is below "
            f"the least this job can train in: {need} MiB (an estimate of {choice.total_mib} "
            f"MiB and its error), with {choice.words}, for rows of {longest} tokens; give it "
            f"at least {need + START_NOISE_MIB} MiB, or lower "
            "batch_size or max_seq_len (raising gradient_accumulation keeps the batch)"
        )
    if device.type == "cpu" and choice.plan.frugal_heap:
        lines.log(frugal_host_heap() or "host heap: the C library's default (no glibc mallopt)")
    return choice, sizing


def guard_memory(
    loop: Loop, job: JobFile, choice: MemoryPlan, sizing: Sizing | None, lines: LineWriter
) -> None:
    """Set the loop to the plan's forward passes and give it the guard that
    keeps its steps within the budget, tightening the plan as it goes."""
    card = loop.device.type == "cuda"
    meter = PeakMeter(loop.device, CUDA_CONTEXT_MIB if card else 0, job.gpu_memory_mib)
    meter.read()  # the weights' loading: not a step's peak
    if sizing is not None and loop.device.type == "cpu":
        sizing.recount_process()  # what the loading added beside the weights
    guard = MemoryGuard(sizing, job.gpu_memory_mib, choice.plan, meter, lines)
    applied = {"heap": choice.plan.frugal_heap}

    longest = 0 if sizing is None else sizing.longest

    def apply(plan: Plan) -> None:
        enable_checkpointing(loop.model, plan.every)
        loop.micro_tokens = plan.micro_rows * longest
        if plan.frugal_heap and not applied["heap"]:
            applied["heap"] = True
            lines.log(frugal_host_heap() or "host heap: the C library's default (no mallopt)")
        elif loop.device.type == "cpu":
            trim_host_heap()  # the old plan's freed pages: not the new one's to carry

    guard.apply = apply
    loop.micro_tokens = choice.plan.micro_rows * longest
    loop.guard = guard


def describe_memory(job: JobFile, choice: MemoryPlan, loop: Loop) -> dict[str, Any]:
    """The summary's account of the memory: the budget, the plan chosen and
    its estimate, the plan the steps ended with and how often it tightened."""
    guard = loop.guard
    final = choice.plan if guard is None else guard.plan
    return {
        "budget_mib": job.gpu_memory_mib,
        "estimate_mib": choice.total_mib or None,
        "plan": choice.words,
        "final_plan": dataclasses.asdict(final),
        "tightened": 0 if guard is None else guard.tightened,
    }


def running_message(done_steps: int, total_steps: int) -> str:
    """What the running line says: the steps ahead (a resumed run is past step 1)."""
    if done_steps:
        return f"training steps {done_steps + 1} to {total_steps}"
    return f"training {total_steps} steps"


def start_torch(job: JobFile, lines: LineWriter) -> tuple[Any, str]:
    """Import torch, check the card the job asks for and keep to its budget,
    seed; the torch device and the dtype name to train in."""
    import torch

    # Progress bars would fill the stderr tail the agent keeps for the reason of a failure.
    with contextlib.suppress(Exception):
        from transformers.utils import logging as hf_logging

        cast(Any, hf_logging).disable_progress_bar()
    if job.device == "cuda" and not torch.cuda.is_available():
        raise EnvironmentFailureError(
            "the job asks for a card but torch sees none (CUDA_VISIBLE_DEVICES?)"
        )
    dtype = resolve_dtype(job.params.dtype, job.device)
    device = torch.device("cuda:0" if job.device == "cuda" else "cpu")
    if device.type == "cuda" and job.gpu_memory_mib is not None:
        lines.log(cap_card_memory(device, job.gpu_memory_mib))
    random.seed(job.params.seed)
    torch.manual_seed(job.params.seed)
    return device, dtype


@dataclasses.dataclass
class Inputs:
    """The records as training reads them, planned before the weights load."""

    records: list[tuple[int, Record]]
    split: tuple[list[int], list[int]]
    template: str
    pad_id: int
    tokens: Tokens
    total_steps: int


def prepare_inputs(
    base_dir: Path,
    records: list[tuple[int, Record]],
    split: tuple[list[int], list[int]],
    p: Params,
    lines: LineWriter,
) -> Inputs:
    """The tokenizer, its template and what step 1 needs tokenized (all the
    training records without max_steps, else the first windows of epoch 1):
    before the weights load, so a bad record or too short a max_seq_len fails
    fast and the lengths are known early."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(base_dir), trust_remote_code=False)
    template = chat_template_of(tokenizer)
    if template is PLAIN_TEMPLATE:
        lines.log("the tokenizer has no chat template; records are rendered with the plain one")
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    rows = len(records) * (2 if p.method == PREFERENCE else 1)  # a pair is two rows
    tokens = tokens_of(tokenizer, template, records, p, preparing_progress(rows, lines))
    total_steps = plan_total_steps(tokens, split[0], p)
    if p.max_steps > 0:
        first = plan_grouped(
            split[0], p.batch_size, p.gradient_accumulation, p.seed + 1, tokens.lengths, p.max_steps
        )
        if not first:
            raise BadInputError(NO_ANSWER.format(p.max_seq_len))
    log_cuts(tokens, p.max_seq_len, lines)
    if tokens.done:  # always, past plan_total_steps and the first plan
        lines.emit(
            Event.LENGTHS,
            records_tokenized=tokens.done,
            records_cut=tokens.cut,
            records_skipped=tokens.skipped,
            **tokens.length_summary(),
        )
    tokens.on_progress = lambda done: None  # past preparing: no more state lines
    return Inputs(records, split, template, pad_id, tokens, total_steps)


def tokens_of(
    tokenizer: Any,
    template: str,
    records: list[tuple[int, Record]],
    p: Params,
    progress: Callable[[int], None],
) -> Tokens:
    """The records' Tokens: a DPO job's pairs as PairTokens (two rows each)."""
    if p.method != PREFERENCE:
        convs = [(n, r) for n, r in records if not isinstance(r, Preference)]
        return Tokens(tokenizer, template, convs, p.max_seq_len, progress)
    pairs = [(n, r) for n, r in records if isinstance(r, Preference)]
    return PairTokens(tokenizer, template, pair_rows(pairs), p.max_seq_len, progress, True)


def describe_inputs(job: JobFile, inputs: Inputs, base_dir: Path) -> dict[str, Any]:
    """The training summary's account of what was trained on."""
    tokens, (train, held_out) = inputs.tokens, inputs.split
    return {
        "job_id": job.job_id,
        "params": dataclasses.asdict(job.params),
        "base": {
            "hf_repo": job.base.hf_repo,
            "hf_revision": job.base.hf_revision if job.base.hf_repo else None,
            "local_dir": job.base.local_dir,
            "base_dir": str(base_dir),
        },
        "data_sha256": job.data_sha256,
        "eval_data_sha256": job.eval_data_sha256,
        # The data file's records (an evaluation set's come after them).
        "records": len(inputs.records) - (len(held_out) if job.eval_data_path else 0),
        "records_train": len(train),
        "records_eval": len(held_out),
        # Cut and skipped are of the records tokenized: fewer than `records`
        # when max_steps ends the job before the data does.
        "records_cut": tokens.cut,
        "records_skipped": tokens.skipped,
        "records_tokenized": tokens.done,
        "token_lengths": tokens.length_summary(),
        "chat_template": "plain" if inputs.template is PLAIN_TEMPLATE else "tokenizer",
    }


def describe_training(
    progress: Progress, epochs: int, loop: Loop, dtype: str, started: float
) -> dict[str, Any]:
    """The training summary's account of the run itself. A run resumed
    ("continue") counts its steps, tokens and train time from step 1, those
    trained before the checkpoint too."""
    return {
        "final_loss": progress.last_loss,
        "eval_loss": progress.last_eval,
        "steps": progress.step,
        "epochs": epochs,
        "tokens_seen": progress.tokens,  # padding not counted
        "padding_tokens": progress.padding,
        "train_time_s": round(progress.train_s, 3),
        "wall_time_s": round(time.time() - started, 3),
        "peak_mib": peak_mib(loop),
        "device": str(loop.device),
        "dtype": dtype,
        # A DPO job's held-out rewards, margin and accuracy at the end.
        "preference_eval": loop.objective.last_eval if isinstance(loop.objective, Dpo) else None,
    }


def make_checkpointer(job: JobFile, total_steps: int, lines: LineWriter) -> Checkpointer | None:
    """The job's checkpointer; None without a checkpoint_dir, or with both
    schedules off and no way to ask for one."""
    p = job.params
    asked = job.checkpoint_now_path
    if job.checkpoint_dir is None or not (
        p.checkpoint_every_steps or p.checkpoint_every_s or asked
    ):
        return None
    meta = {"job_id": job.job_id, "fingerprint": fingerprint_of(job, total_steps)}
    return Checkpointer(job.checkpoint_dir, p, total_steps, meta, lines, asked)


def save_adapter(model: Any, adapter_dir: Path, template: str) -> None:
    """The trained adapter, as peft writes it, and the chat template it was trained with."""
    try:
        adapter_dir.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(str(adapter_dir), safe_serialization=True)
        (adapter_dir / CHAT_TEMPLATE).write_text(template, encoding="utf-8")
    except OSError as e:
        raise EnvironmentFailureError(
            f"saving the adapter into {adapter_dir} failed: {type(e).__name__}: {e}"
        ) from e
