"""The agent's PEFT reference: the adapter's probe.json when it holds the
agent's probe, else the probe program (adapter_serving.adapter_reference)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lorafleet_services.agent.serving.vllm_adapters import (
    Continuation,
    ProbeError,
    adapter_reference,
    stored_reference,
)
from lorafleet_trainer.probe import PROBE_DTYPE, PROBE_FILE, PROBE_TEXT, PROBE_TOKENS

#: A Python that cannot run: the program path, if taken, fails loudly.
NO_PYTHON = "/nonexistent/python3"


def probe_json(**changes: Any) -> dict[str, Any]:
    ids = list(range(10, 10 + PROBE_TOKENS))
    data = {
        "text": PROBE_TEXT,
        "dtype": PROBE_DTYPE,
        "token_ids": [1, 2, 3],
        "adapter": {"ids": ids, "logprobs": [-0.5] * PROBE_TOKENS},
        "base": {"ids": ids[::-1], "logprobs": [-1.5] * PROBE_TOKENS},
    }
    return {**data, **changes}


def write(adapter_dir: Path, data: dict[str, Any] | str) -> Path:
    text = data if isinstance(data, str) else json.dumps(data)
    (adapter_dir / PROBE_FILE).write_text(text)
    return adapter_dir


async def test_the_stored_reference_is_used_without_running_the_program(tmp_path: Path) -> None:
    write(tmp_path, probe_json())
    reference = await adapter_reference(NO_PYTHON, "base", tmp_path)
    assert reference.token_ids == [1, 2, 3]
    assert reference.adapter == Continuation(list(range(10, 10 + PROBE_TOKENS)), [-0.5] * 8)
    assert reference.base.logprobs == [-1.5] * PROBE_TOKENS


@pytest.mark.parametrize(
    "data",
    [
        probe_json(text="another prompt"),
        probe_json(dtype="bfloat16"),
        probe_json(adapter={"ids": [1], "logprobs": [-0.5]}),
        {k: v for k, v in probe_json().items() if k != "base"},
        "{not json",
    ],
    ids=["other text", "other dtype", "other length", "no base", "unreadable"],
)
def test_a_probe_json_not_of_the_agents_probe_is_not_used(
    tmp_path: Path, data: dict[str, Any] | str
) -> None:
    assert stored_reference(write(tmp_path, data)) is None


async def test_without_probe_json_the_program_runs(tmp_path: Path) -> None:
    # The program path taken: the Python that cannot run is what fails.
    with pytest.raises(FileNotFoundError):
        await adapter_reference(NO_PYTHON, "base", tmp_path)
    write(tmp_path, probe_json(text="another prompt"))
    with pytest.raises(FileNotFoundError):
        await adapter_reference(NO_PYTHON, "base", tmp_path)


async def test_the_program_failing_is_a_probe_error(tmp_path: Path) -> None:
    import sys

    with pytest.raises(ProbeError, match=r"lorafleet_trainer\.probe failed"):
        await adapter_reference(sys.executable, tmp_path / "no-base", tmp_path)


async def test_the_program_runs_from_the_package_copy(tmp_path: Path) -> None:
    # The agent runs the program from its copy of the trainer package (the
    # engine's Python has no lorafleet): a copy that exits 3 is what ran.
    import sys

    from lorafleet_services.agent.environment.environments import copy_trainer_package

    package = copy_trainer_package(tmp_path / "probe")
    assert (package / "probe.py").is_file() and not list(package.glob("__pycache__"))
    (package / "probe.py").write_text("import sys\nsys.exit(3)\n")
    with pytest.raises(ProbeError, match=r"failed \(3\)"):
        await adapter_reference(sys.executable, "base", tmp_path, package_root=tmp_path / "probe")
