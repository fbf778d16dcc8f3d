"""What a trainer (and the GGUF converter) runs in: the `TrainerEnvironment`
protocol, the `ConversionRequest` its `convert_to_gguf` takes, the variables
every such environment sets (RUN_ENV), and `TrainerSetupError`, raised when
a node cannot provide one.

Its two kinds live in agent/environment/environments.py: `EngineEnvironment` (the
node's engine Python, its overlay and user) and `StandinEnvironment` (the
stand-in trainer's: the agent's own Python and user). The job pipeline
(training/job_run.py) and the conversion (gguf_conversion.py) see only this
protocol.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from lorafleet_services.agent.config import AgentConfig, EngineUser
from lorafleet_services.agent.node.cards import CardChoice

#: In every trainer's and converter's environment, whatever runs it: lines
#: unbuffered (the agent reads them as they come), no progress bars and no
#: tokenizer threads in the output, and a CUDA allocator that returns
#: memory a co-located engine may need.
RUN_ENV: Mapping[str, str] = {
    "PYTHONUNBUFFERED": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
}
#: Thread counts the operator set for the agent, passed on to the trainer
#: when set: on a CPU node the trainer otherwise takes a thread per core,
#: beside whatever else runs there.
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def thread_env(base: Mapping[str, str]) -> dict[str, str]:
    """The THREAD_VARS that `base` sets."""
    return {k: base[k] for k in THREAD_VARS if k in base}


class TrainerSetupError(RuntimeError):
    """The node cannot run the trainer as configured; the message says what
    to install or change."""


@dataclass(frozen=True, slots=True)
class ConversionRequest:
    """One adapter to convert to GGUF: the PEFT adapter in `adapter_dir`,
    trained on the Hugging Face model in `base_dir`, written to `out` for the
    job `job_id`; setting `cancel` stops the conversion."""

    cfg: AgentConfig
    job_id: str
    adapter_dir: Path
    base_dir: Path
    out: Path
    cancel: asyncio.Event


class TrainerEnvironment(Protocol):
    """What a trainer (and the GGUF converter) runs in: its Python, its user,
    its process environment, and how it makes the adapter's GGUF."""

    @property
    def python(self) -> str: ...

    @property
    def user(self) -> EngineUser | None: ...

    @property
    def notes(self) -> tuple[str, ...]: ...

    def process_env(
        self, choice: CardChoice, extra: Mapping[str, str] | None = None
    ) -> dict[str, str]: ...

    def give(self, path: Path) -> None: ...

    async def convert_to_gguf(self, request: ConversionRequest) -> str | None:
        """Write the GGUF of `request.adapter_dir` to `request.out`; answers
        what the job's report should say of it, or None. Setting
        `request.cancel` stops it. Raises conversion.ConversionError when it
        cannot."""
        ...
