"""The PEFT probe reference (lorafleet_trainer.probe): the trainer's, written
into the adapter it saves, answers what the standalone program answers."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lorafleet_trainer.probe import (
    PROBE_DTYPE,
    PROBE_FILE,
    PROBE_TEXT,
    PROBE_TOKENS,
    write_probe,
)
from tests.trainer.harness import TrainerRun

Trained = Callable[[str], tuple[TrainerRun, Path]]
#: The trainer's reference against the program's, on the same base and adapter.
SAME_WITHIN = 1e-5


def program_reference(base_dir: str, adapter_dir: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "lorafleet_trainer.probe", base_dir, adapter_dir],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return dict(json.loads(out.stdout))


def test_the_trainers_probe_json_answers_what_the_program_answers(trained: Trained) -> None:
    run, _ = trained("llama")
    (done,) = run.events("done")
    stored = json.loads((Path(done["adapter_dir"]) / PROBE_FILE).read_text())
    program = program_reference(done["base_dir"], done["adapter_dir"])
    assert set(stored) == set(program) == {"text", "dtype", "token_ids", "adapter", "base"}
    assert stored["text"] == program["text"] == PROBE_TEXT
    assert stored["dtype"] == program["dtype"] == PROBE_DTYPE
    assert stored["token_ids"] == program["token_ids"]
    for side in ("adapter", "base"):
        assert stored[side]["ids"] == program[side]["ids"], side
        assert len(stored[side]["ids"]) == PROBE_TOKENS
        gaps = [
            abs(a - b)
            for a, b in zip(stored[side]["logprobs"], program[side]["logprobs"], strict=True)
        ]
        assert max(gaps) <= SAME_WITHIN, (side, gaps)
    # The adapter was trained (dropout 0.05: eval mode matters): it answers
    # apart from its base, so the check above compares two different things.
    assert stored["adapter"] != stored["base"]


def test_a_model_trained_in_bf16_writes_no_probe_json(tmp_path: Path) -> None:
    # Its weights and arithmetic are not the program's float32: the agent runs it.
    why = write_probe(object(), tmp_path, tmp_path, "bf16")
    assert why is not None and "bf16" in why and PROBE_DTYPE in why
    assert list(tmp_path.iterdir()) == []


def test_the_program_refuses_a_wrong_command_line() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "lorafleet_trainer.probe", "only-one"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "BASE_DIR ADAPTER_DIR" in out.stderr
