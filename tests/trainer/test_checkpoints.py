"""Checkpoints and resume with the real trainer on the CPU: where checkpoints
appear and what they hold, that an interrupted run resumed from one ends as
the uninterrupted run does, and what a resume refuses."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from lorafleet_trainer.checkpoints import (
    CheckpointWriter,
    Snapshot,
    checkpoint_due,
    write_checkpoint,
)
from lorafleet_trainer.jobfile import JobFile, Resume
from lorafleet_trainer.loop import prepare_training
from lorafleet_trainer.params import Params
from lorafleet_trainer.protocol import (
    BadInputError,
    CheckpointAsks,
    EnvironmentFailureError,
    LineWriter,
    is_environment_failure,
)
from lorafleet_trainer.resume import (
    load_adapter_weights,
    locate_checkpoint,
    read_checkpoint_meta,
    resume_source,
)
from lorafleet_trainer.run import run
from tests.trainer.harness import (
    TrainerRun,
    ndjson,
    qa_records,
    run_trainer,
    start_trainer,
    write_job,
)
from tests.trainer.test_protocol import _decode_strictly

pytestmark = pytest.mark.slow

#: 14 training records, batches of 4: 4 steps an epoch, 6 epochs. Dropout on,
#: so that a resume that does not restore the RNG states draws other masks.
PARAMS: dict[str, Any] = {
    "rank": 8,
    "alpha": 16,
    "dropout": 0.1,
    "learning_rate": 0.02,
    "lr_scheduler": "cosine",
    "warmup_steps": 2,
    "max_steps": 24,
    "batch_size": 4,
    "eval_fraction": 0.125,
    "max_seq_len": 64,
    "seed": 7,
    "checkpoint_every_steps": 4,
    "checkpoint_every_s": 0,
}
STEPS = 24
FILES = {"adapter_model.safetensors", "adapter_config.json", "trainer_state.pt", "checkpoint.json"}


def _job(job_dir: Path, base: Path, **overrides: Any) -> Path:
    params = {**PARAMS, **overrides.pop("params", {})}
    overrides.setdefault("checkpoint_dir", str(job_dir / "checkpoints"))
    return write_job(job_dir, base, data=ndjson(qa_records()), params=params, **overrides)


@pytest.fixture(scope="module")
def uninterrupted(
    tiny_model: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[TrainerRun, Path]:
    """The job run to its end, a checkpoint every 4 steps; and its directory."""
    job_dir = tmp_path_factory.mktemp("uninterrupted")
    run = run_trainer(_job(job_dir, tiny_model("llama")))
    assert run.rc == 0, run.stderr[-3000:]
    return run, job_dir


def _losses(run: TrainerRun, after: int = 0) -> list[tuple[int, float, float]]:
    return [
        (s["step"], s["loss"], s["learning_rate"]) for s in run.events("step") if s["step"] > after
    ]


def _evals(run: TrainerRun, after: int = 0) -> list[tuple[int, float]]:
    return [(e["step"], e["eval_loss"]) for e in run.events("eval") if e["step"] >= after]


def _max_adapter_difference(a: Path, b: Path) -> float:
    from safetensors.torch import load_file

    wa = load_file(str(a / "adapter_model.safetensors"))
    wb = load_file(str(b / "adapter_model.safetensors"))
    assert set(wa) == set(wb) and wa
    return max(float((wa[k] - wb[k]).abs().max()) for k in wa)


def test_checkpoints_appear_at_their_steps_complete(
    uninterrupted: tuple[TrainerRun, Path], tiny_model: Callable[[str], Path]
) -> None:
    run, job_dir = uninterrupted
    ckpt_dir = job_dir / "checkpoints"
    lines = run.events("checkpoint")
    # Every 4 steps, and not after the last (24): the adapter is the result then.
    assert [(x["step"], x["epoch"]) for x in lines] == [(4, 1), (8, 2), (12, 3), (16, 4), (20, 5)]
    assert [x["path"] for x in lines] == [
        str(ckpt_dir / f"step-{s:08d}") for s in (4, 8, 12, 16, 20)
    ]
    kinds = [(x["event"], x.get("step")) for x in run.lines]
    for x in lines:  # printed once the step is done, and before the adapter is saved
        assert kinds.index(("step", x["step"])) < kinds.index(("checkpoint", x["step"]))
        assert kinds.index(("checkpoint", x["step"])) < kinds.index(("done", None))
    assert sorted(os.listdir(ckpt_dir)) == [f"step-{s:08d}" for s in (4, 8, 12, 16, 20)]
    _decode_strictly(run)  # the checkpoint lines are the schemas' TrainerCheckpoint

    adapter = Path(run.events("done")[0]["adapter_dir"])
    for x in lines:
        d = Path(x["path"])
        assert set(os.listdir(d)) == FILES
        meta = json.loads((d / "checkpoint.json").read_text())
        assert meta["format"] == 1 and meta["step"] == x["step"] and meta["epoch"] == x["epoch"]
        assert meta["position"] == {"epoch": x["epoch"], "index": 4}
        assert meta["progress"]["step"] == x["step"]
        assert meta["files"] == {f: (d / f).stat().st_size for f in FILES - {"checkpoint.json"}}
        assert meta["fingerprint"]["seed"] == 7 and meta["fingerprint"]["total_steps"] == STEPS
        assert (
            meta["fingerprint"]["data_sha256"]
            == json.loads((job_dir / "job.json").read_text())["data_sha256"]
        )
        # Only the LoRA weights: as large as the adapter's, far below the base's.
        size = (d / "adapter_model.safetensors").stat().st_size
        assert size == (adapter / "adapter_model.safetensors").stat().st_size
        assert size < (tiny_model("llama") / "model.safetensors").stat().st_size / 5
    assert run.events("done")[0]["summary"]["checkpoints"] == 5


def test_a_run_killed_and_resumed_ends_as_the_uninterrupted_one(
    uninterrupted: tuple[TrainerRun, Path], tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    """SIGKILL after step k, resume "continue" from the newest checkpoint c <= k
    in a fresh process: the same losses from c + 1 on, the same adapter."""
    base = tiny_model("llama")
    # Another checkpoint cadence than the uninterrupted run's (not part of the
    # fingerprint): the checkpoints land mid-epoch, and writing them changes nothing.
    killed_job = _job(tmp_path / "killed", base, params={"checkpoint_every_steps": 5})
    seen: list[dict[str, Any]] = []
    with start_trainer(killed_job) as p:
        try:
            assert p.stdout is not None
            for raw in p.stdout:
                seen.append(json.loads(raw))
                ckpts = [x["step"] for x in seen if x["event"] == "checkpoint"]
                if ckpts and seen[-1]["event"] == "step" and seen[-1]["step"] >= 7:
                    break
            os.kill(p.pid, signal.SIGKILL)
            assert p.wait(timeout=30) == -signal.SIGKILL, seen[-3:]
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    killed = TrainerRun(-9, [], seen, "")
    c = max(x["step"] for x in killed.events("checkpoint"))
    k = max(x["step"] for x in killed.events("step"))
    assert 5 <= c < k < STEPS
    run, job_dir = uninterrupted
    # Up to the kill, the same steps as the uninterrupted run (other checkpoints).
    assert _losses(killed) == _losses(run)[:k]

    # The same job (its checkpoint directory too: the resumed run clears what
    # the kill may have left half-written there, and rewrites later steps).
    resumed_job = _job(
        tmp_path / "resumed",
        base,
        params={"checkpoint_every_steps": 5},
        checkpoint_dir=str(tmp_path / "killed" / "checkpoints"),
        resume={
            "dir": str(tmp_path / "killed" / "checkpoints" / f"step-{c:08d}"),
            "mode": "continue",
        },
    )
    resumed = run_trainer(resumed_job)
    assert resumed.rc == 0, resumed.stderr[-3000:]
    assert resumed.events("step")[0]["step"] == c + 1
    assert _losses(resumed) == _losses(run, after=c)
    assert _evals(resumed) == _evals(run, after=c + 1)
    assert (
        _max_adapter_difference(
            Path(resumed.events("done")[0]["adapter_dir"]), job_dir / "out" / "adapter"
        )
        <= 1e-6
    )
    summary = resumed.events("done")[0]["summary"]
    assert summary["resumed_from"]["mode"] == "continue" and summary["resumed_from"]["step"] == c
    assert (
        summary["steps"] == STEPS
        and summary["tokens_seen"] == run.events("done")[0]["summary"]["tokens_seen"]
    )
    names = os.listdir(tmp_path / "killed" / "checkpoints")
    assert not [n for n in names if n.startswith(".tmp-")], names
    assert {f"step-{s:08d}" for s in (5, 10, 15, 20)} <= set(names)


def test_a_resume_at_an_epochs_last_step_evaluates_that_epoch_then_goes_on(
    uninterrupted: tuple[TrainerRun, Path], tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    run, job_dir = uninterrupted
    job = _job(
        tmp_path / "j",
        tiny_model("llama"),
        resume={"dir": str(job_dir / "checkpoints" / "step-00000008"), "mode": "continue"},
    )
    resumed = run_trainer(job)
    assert resumed.rc == 0, resumed.stderr[-3000:]
    assert _losses(resumed) == _losses(run, after=8)
    # Epoch 2's eval (after step 8) comes first: the checkpoint was taken before it.
    assert _evals(resumed) == _evals(run, after=8)
    assert resumed.events("eval")[0]["step"] == 8
    assert (
        _max_adapter_difference(
            Path(resumed.events("done")[0]["adapter_dir"]), job_dir / "out" / "adapter"
        )
        <= 1e-6
    )


def test_weights_mode_starts_from_another_runs_adapter(
    uninterrupted: tuple[TrainerRun, Path], tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    """Only the weights: this job's own schedule from step 1 (the learning rate
    warms up from 0 again; another max_steps, which "continue" would refuse),
    the same first batch as a fresh adapter's (the seed's) at a much lower loss.
    Its checkpoints come by time here: after every step but the last."""
    run, job_dir = uninterrupted
    job = _job(
        tmp_path / "j",
        tiny_model("llama"),
        params={"max_steps": 3, "checkpoint_every_steps": 0, "checkpoint_every_s": 1e-6},
        resume={"dir": str(job_dir / "out" / "adapter"), "mode": "weights"},
    )
    other = run_trainer(job)
    assert other.rc == 0, other.stderr[-3000:]
    steps = other.events("step")
    assert [s["step"] for s in steps] == [1, 2, 3] and steps[0]["learning_rate"] == 0.0
    fresh_first = run.events("step")[0]["loss"]
    assert steps[0]["loss"] < 0.6 * fresh_first, (steps[0]["loss"], fresh_first)
    summary = other.events("done")[0]["summary"]
    assert summary["resumed_from"] == {
        "mode": "weights",
        "dir": str(job_dir / "out" / "adapter"),
        "step": 0,
    }
    assert [x["step"] for x in other.events("checkpoint")] == [1, 2]
    assert summary["checkpoints"] == 2


def test_a_resume_by_epochs_with_accumulation_ends_the_same(
    tiny_model: Callable[[str], Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without max_steps (the epochs' plans uncut) and with steps of several
    micro-batches, the last one short: in this process, to spare the imports
    (the SIGKILL test above runs real processes)."""
    import io
    import warnings

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # 14 records, micro-batches of 3 (5 an epoch), 2 a step: 3 steps an epoch, 9 in all.
    params = {"max_steps": 0, "epochs": 3, "batch_size": 3, "gradient_accumulation": 2}
    params["checkpoint_every_steps"] = 2

    def train(name: str, **overrides: Any) -> TrainerRun:
        out = io.StringIO()
        job = _job(tmp_path / name, tiny_model("llama"), params=params, **overrides)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # peft on transformers' renames
            assert run(JobFile.read(job), LineWriter(out)) == 0
        return TrainerRun(0, [], [json.loads(x) for x in out.getvalue().splitlines()], "")

    whole = train("whole")
    assert [s["epoch"] for s in whole.events("step")] == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    ckpt = tmp_path / "whole" / "checkpoints" / "step-00000004"
    assert json.loads((ckpt / "checkpoint.json").read_text())["position"] == {
        "epoch": 2,
        "index": 1,
    }
    resumed = train("resumed", resume={"dir": str(ckpt), "mode": "continue"})
    assert _losses(resumed) == _losses(whole, after=4)
    assert _evals(resumed) == _evals(whole, after=5)
    assert (
        _max_adapter_difference(
            tmp_path / "resumed" / "out" / "adapter", tmp_path / "whole" / "out" / "adapter"
        )
        <= 1e-6
    )


def _refused(job: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The trainer's run (in this process, to spare the imports) refuses `job`
    as bad input before any weight loads; answers the message."""
    import io

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = io.StringIO()
    with pytest.raises(BadInputError) as e:
        run(JobFile.read(job), LineWriter(out))
    states = [json.loads(x).get("state") for x in out.getvalue().splitlines()]
    assert "running" not in states
    return str(e.value)


def test_a_resume_of_another_jobs_settings_is_refused_naming_what_differs(
    uninterrupted: tuple[TrainerRun, Path],
    tiny_model: Callable[[str], Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, job_dir = uninterrupted
    ckpt = job_dir / "checkpoints" / "step-00000008"
    job = _job(
        tmp_path / "j",
        tiny_model("llama"),
        params={"seed": 8, "max_steps": 30},
        resume={"dir": str(ckpt), "mode": "continue"},
    )
    message = _refused(job, monkeypatch)
    assert message.startswith(f"the checkpoint {ckpt} was written for other data or parameters: ")
    assert "seed 7 there, 8 here" in message and "total_steps 24 there, 30 here" in message
    assert "rank" not in message
    assert message.endswith('or start from its weights (resume.mode "weights")')


def test_a_half_written_checkpoint_is_refused(
    uninterrupted: tuple[TrainerRun, Path],
    tiny_model: Callable[[str], Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What a crash mid-write leaves (a .tmp-* directory) is never resumed from."""
    _, job_dir = uninterrupted
    tmp = tmp_path / ".tmp-step-00000008"
    shutil.copytree(job_dir / "checkpoints" / "step-00000008", tmp)
    job = _job(tmp_path / "j", tiny_model("llama"), resume={"dir": str(tmp), "mode": "continue"})
    assert _refused(job, monkeypatch) == (
        f"{tmp} is a checkpoint that was still being written (.tmp-* directories are "
        "incomplete); resume from a step-* directory"
    )


def test_a_checkpoint_directory_that_cannot_be_written_is_a_failure_of_the_node(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    """Exit 3 (retryable elsewhere), before any training is lost."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the checkpoints would go")
    job = _job(tmp_path / "j", tiny_model("llama"), checkpoint_dir=str(blocker / "checkpoints"))
    run = run_trainer(job)
    assert run.rc == 3, run.stderr[-2000:]
    assert run.lines[-1]["message"].startswith(
        f"the checkpoint directory {blocker / 'checkpoints'} cannot be written: "
    )
    assert not run.events("step")


# --- in this process: the pieces -------------------------------------------------


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_what_is_not_a_complete_checkpoint_is_refused_with_what_is_wrong(
    uninterrupted: tuple[TrainerRun, Path], tmp_path: Path
) -> None:
    _, job_dir = uninterrupted
    good = job_dir / "checkpoints" / "step-00000004"
    assert read_checkpoint_meta(good)["step"] == 4

    no_meta = _copy(good, tmp_path / "a" / "step-00000004")
    (no_meta / "checkpoint.json").unlink()
    with pytest.raises(BadInputError, match=r"has no checkpoint.json: it is not a complete"):
        read_checkpoint_meta(no_meta)
    other_format = _copy(good, tmp_path / "b" / "step-00000004")
    meta = json.loads((other_format / "checkpoint.json").read_text())
    (other_format / "checkpoint.json").write_text(json.dumps({**meta, "format": 2}))
    with pytest.raises(BadInputError, match=r"has format 2; this trainer reads format 1"):
        read_checkpoint_meta(other_format)
    cut = _copy(good, tmp_path / "c" / "step-00000004")
    state = cut / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:100])
    with pytest.raises(BadInputError, match=r"trainer_state.pt is missing or not the \d+ bytes"):
        read_checkpoint_meta(cut)
    torn = _copy(good, tmp_path / "d" / "step-00000004")
    (torn / "checkpoint.json").write_text('{"format": 1, "st')
    with pytest.raises(BadInputError, match=r"checkpoint.json is not JSON"):
        read_checkpoint_meta(torn)

    # A directory of checkpoints: its newest complete one; .tmp-* and
    # directories without checkpoint.json are passed over.
    parent = tmp_path / "parent"
    _copy(good, parent / "step-00000004")
    _copy(no_meta, parent / "step-00000008")
    _copy(good, parent / ".tmp-step-00000012")
    assert locate_checkpoint(parent) == parent / "step-00000004"
    # "weights" takes a checkpoint (the newest of a directory of them) or a
    # peft adapter directory, never a .tmp-* one that looks like an adapter.
    weights = Resume(dir=parent, mode="weights")
    assert resume_source(weights)[0] == parent / "step-00000004"
    adapter = job_dir / "out" / "adapter"
    assert resume_source(Resume(dir=adapter, mode="weights")) == (adapter, None)
    with pytest.raises(BadInputError, match="still being written"):
        resume_source(Resume(dir=parent / ".tmp-step-00000012", mode="weights"))
    with pytest.raises(BadInputError, match=r"has no checkpoint\.json"):
        resume_source(Resume(dir=adapter, mode="continue"))
    (parent / "step-00000004" / "checkpoint.json").unlink()
    with pytest.raises(BadInputError, match=r"has no checkpoint\.json"):
        read_checkpoint_meta(locate_checkpoint(parent))


def test_an_adapter_of_another_rank_does_not_load(
    uninterrupted: tuple[TrainerRun, Path],
    tiny_model: Callable[[str], Path],
) -> None:
    import warnings

    import torch
    from transformers import AutoModelForCausalLM

    _, job_dir = uninterrupted
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model("llama")), dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # peft on transformers' renames
        loop = prepare_training(model, Params(rank=4), "fp32", torch.device("cpu"), 10)
    with pytest.raises(BadInputError) as e:
        load_adapter_weights(loop.model, job_dir / "out" / "adapter", loop.device)
    assert "it has rank 8 on 14 modules, this job rank 4 on 14 modules" in str(e.value)


def test_a_checkpoint_asked_for_comes_after_the_next_step_and_once(
    tmp_path: Path, tiny_model: Callable[[str], Path]
) -> None:
    """Both schedules off; the agent's ask (a token in the file) is there
    before the first step: one checkpoint, after step 1, none after."""
    asked = tmp_path / "checkpoint-now"
    asked.write_text("1\n")
    job = _job(
        tmp_path, tiny_model("llama"), checkpoint_now_path=str(asked),
        params={"max_steps": 4, "checkpoint_every_steps": 0},
    )  # fmt: skip
    run = run_trainer(job)
    assert run.rc == 0, run.stderr[-3000:]
    assert [x["step"] for x in run.events("checkpoint")] == [1]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step-00000001"]


def test_an_ask_is_one_token_the_trainer_has_not_seen(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint-now"
    asks = CheckpointAsks(path)
    assert not asks.asked()  # no file
    path.write_text("1\n")
    assert asks.asked() and not asks.asked()  # the same token again is no ask
    path.write_text("2\n")
    assert asks.asked()
    assert not CheckpointAsks(None).asked()


def test_checkpoints_are_due_by_steps_or_time_never_at_the_end() -> None:
    due = checkpoint_due
    assert [s for s in range(1, 13) if due(s, 12, 4, 0.0, 0.0)] == [4, 8]
    assert due(3, 12, 0, 600.0, 600.0) and not due(3, 12, 0, 600.0, 599.9)
    assert not due(12, 12, 1, 1.0, 1e9)  # the last step: the adapter is the result
    assert not due(5, 12, 0, 0.0, 1e9)  # both off


def test_a_failed_checkpoint_write_is_a_failure_of_the_node(tmp_path: Path) -> None:
    """An OSError while writing (here: the directory vanished) surfaces at the
    next step as exit 3's error; another exception as it is."""
    writer = CheckpointWriter(tmp_path / "gone", LineWriter(io.StringIO()))
    snap = Snapshot({}, {}, "{}", {"step": 3, "epoch": 1})
    (tmp_path / "gone").write_text("a file, not a directory")
    writer.submit(snap)
    with pytest.raises(EnvironmentFailureError, match="writing the checkpoint of step 3 into"):
        writer.wait()
    writer.wait()  # reported once


def test_a_step_written_again_replaces_its_checkpoint_whole(tmp_path: Path) -> None:
    """A resumed run passing a step the lost run had checkpointed too: the new
    checkpoint takes the name, nothing of the old or of the temporary is left."""
    import torch

    def snap(value: float) -> Any:
        meta = {"format": 1, "step": 7, "epoch": 2, "position": {"epoch": 2, "index": 3}}
        return Snapshot({"w": torch.full((2,), value)}, {}, "{}", {**meta, "progress": {}})

    first = write_checkpoint(tmp_path, snap(1.0))
    (first / "stale").write_text("only in the first")
    again = write_checkpoint(tmp_path, snap(2.0))
    assert again == first == tmp_path / "step-00000007"
    assert os.listdir(tmp_path) == ["step-00000007"]
    assert sorted(os.listdir(again)) == sorted(FILES)
    assert read_checkpoint_meta(again)["step"] == 7
    from safetensors.torch import load_file

    assert load_file(str(again / "adapter_model.safetensors"))["w"].tolist() == [2.0, 2.0]


@pytest.mark.parametrize(
    ("message", "node"),
    [
        ("CUDA error: uncorrectable ECC error encountered", True),
        ("CUDA error: unspecified launch failure", True),
        ("CUDA driver version is insufficient for CUDA runtime version", True),
        ("CUDA error: out of memory", False),
        ("CUDA error: device-side assert triggered", False),
        ("mat1 and mat2 shapes cannot be multiplied", False),
    ],
)
def test_card_and_driver_errors_are_the_nodes(message: str, node: bool) -> None:
    assert is_environment_failure(RuntimeError(message)) is node
