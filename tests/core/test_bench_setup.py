"""bench/trainer_trl.py's set-up lines work: the environment they make
imports lorafleet's three roots (the TRL install itself is left out: it
needs the network)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "trainer_trl.py"
#: Seconds a fresh venv (no pip) and an import may take.
SETUP_TIMEOUT_S = 60


def setup_lines() -> list[str]:
    """The shell lines of the bench docstring's first block, continuations joined,
    the TRL install and the bench run left out."""
    doc = BENCH.read_text().split('"""')[1]
    block = doc.split("\n\n")[1].replace("\\\\\n", " ")
    return [
        line.strip()
        for line in block.splitlines()
        if line.strip() and "pip install" not in line and "trainer_trl.py" not in line
    ]


@pytest.mark.skipif(
    Path(sys.prefix).resolve() != (ROOT / ".venv").resolve(),
    reason="the set-up lines name the project's .venv: run from it",
)
def test_the_trl_bench_set_up_lines_make_an_environment_that_imports_lorafleet(
    tmp_path: Path,
) -> None:
    lines = [re.sub(r"/tmp/trlenv", str(tmp_path / "trlenv"), line) for line in setup_lines()]
    assert any(".pth" in line for line in lines), lines
    # --without-pip: the bench's pip is not what is tested, and it is slow to make.
    lines = [
        line.replace("python -m venv", f"{sys.executable} -m venv --without-pip") for line in lines
    ]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run(
        ["bash", "-euo", "pipefail", "-c", "\n".join(lines)],
        cwd=ROOT, env=env, check=True, timeout=SETUP_TIMEOUT_S,
    )  # fmt: skip
    python = tmp_path / "trlenv" / "bin" / "python"
    found = subprocess.run(
        [str(python), "-c", "import lorafleet_schemas.messages, lorafleet, lorafleet_services"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=SETUP_TIMEOUT_S,
    )  # fmt: skip
    assert found.returncode == 0, found.stderr
