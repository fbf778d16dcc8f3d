"""The trainer's environment on a node: the two `TrainerEnvironment`s
(environment/protocol.py) and how the agent gets one.

- `EngineEnvironment`: the node's engine Python, `cfg.python`, else the
  newest vLLM's `<engines_dir>/vllm/<version>/bin/python3`
  (agent/node/installed_engines.py orders them; its torch already matches
  the node's CUDA: no second environment), importing peft and accelerate
  from its pinned overlay (environment/overlay.py), run as the engines'
  user (environment/engines_user.py) with a clean process environment
  built from nothing.
- `StandinEnvironment`: the stand-in trainer's, the agent's own Python and
  user; its GGUF is the stand-in's bytes, not a conversion.

`trainer_environment(cfg)` answers the one cfg asks for. See
agent/DESIGN.md.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import lorafleet_services.agent.environment.gguf_conversion as conversion
import lorafleet_services.agent.node.installed_engines as engines
import lorafleet_trainer
from lorafleet_services.agent.config import AgentConfig, EngineUser
from lorafleet_services.agent.environment.engines_user import chown_tree, self_user, settle_user
from lorafleet_services.agent.environment.overlay import ensure_overlay
from lorafleet_services.agent.environment.protocol import (
    RUN_ENV,
    ConversionRequest,
    TrainerEnvironment,
    TrainerSetupError,
    thread_env,
)
from lorafleet_services.agent.environment.setup_runs import SYSTEM_PATH
from lorafleet_services.agent.node.cards import CardChoice
from lorafleet_trainer.standin import gguf_bytes


@dataclass(frozen=True)
class EngineEnvironment:
    """The node's engine Python, prepared to train (a TrainerEnvironment)."""

    #: The interpreter that trains.
    python: str
    #: The overlay directory (first); nothing of lorafleet's.
    pythonpath: tuple[str, ...]
    #: None: runs as the agent's own user.
    user: EngineUser | None
    #: The trainer's home (its caches).
    home: Path
    #: HF_HOME: cfg.hf_home (shared with the engines), or under home.
    hf_home: Path
    #: What the job's log and message should say (each says how to fix it).
    notes: tuple[str, ...]
    #: HF_HUB_OFFLINE=1 for the trainer; default False.
    hf_offline: bool = False

    def process_env(
        self, choice: CardChoice, extra: Mapping[str, str] | None = None
    ) -> dict[str, str]:
        """The trainer's whole environment, built from nothing (the agent's
        own never leaks in: no LORAFLEET_*, no virtualenv, no proxy secrets).
        `extra` is added last and wins."""
        who = (self.user or self_user(self.home)).env()
        env = {
            "PATH": f"{Path(self.python).parent}:{SYSTEM_PATH}",
            "LANG": os.environ.get("LANG") or "C.UTF-8",
            "PYTHONNOUSERSITE": "1",
            **RUN_ENV,
            **thread_env(os.environ),
            **who,
            "HF_HOME": str(self.hf_home),
            # NVML numbers cards in PCI bus order; CUDA's default order is
            # fastest first, so without this the index could name another card.
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            "CUDA_VISIBLE_DEVICES": "" if choice.index is None else str(choice.index),
        }
        if self.pythonpath:
            env["PYTHONPATH"] = os.pathsep.join(self.pythonpath)
        if self.hf_offline:
            env["HF_HUB_OFFLINE"] = "1"
        env.update(extra or {})
        return env

    def give(self, path: Path) -> None:
        """Hand `path` and everything under it to the trainer's user (no-op
        when the trainer runs as the agent)."""
        if self.user is not None:
            chown_tree(path, self.user.uid, self.user.gid)

    async def convert_to_gguf(self, request: ConversionRequest) -> str | None:
        """llama.cpp's converter, in this Python as this user (gguf_conversion.py)."""
        r = request
        await conversion.convert_to_gguf(r.cfg, self, r.adapter_dir, r.base_dir, r.out, r.cancel)
        return None


@dataclass(slots=True)
class StandinEnvironment:
    """The stand-in trainer's environment (a TrainerEnvironment): the agent's
    own Python and user.

    The LORAFLEET_STANDIN_* knobs reach the trainer from the agent's
    environment; the agent's other LORAFLEET_* settings do not.
    """

    python: str = sys.executable
    user: EngineUser | None = None
    notes: tuple[str, ...] = ()
    base_env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))

    def process_env(
        self, choice: CardChoice, extra: Mapping[str, str] | None = None
    ) -> dict[str, str]:
        env = {
            k: v
            for k, v in self.base_env.items()
            if not k.startswith("LORAFLEET_") or k.startswith("LORAFLEET_STANDIN_")
        }
        env.update(RUN_ENV)
        env["CUDA_VISIBLE_DEVICES"] = "" if choice.index is None else str(choice.index)
        env.update(extra or {})
        return env

    def give(self, path: Path) -> None:
        return None

    async def convert_to_gguf(self, request: ConversionRequest) -> str | None:
        """No conversion: the stand-in's GGUF bytes for this job."""
        await asyncio.to_thread(request.out.write_bytes, gguf_bytes(request.job_id))
        return "stand-in trainer: a stand-in GGUF, not a conversion"


def find_python(cfg: AgentConfig) -> str:
    """cfg.python (a path, or a name on PATH); else the newest
    `<engines_dir>/vllm/<version>/bin/python3`; else TrainerSetupError."""
    if cfg.python:
        found = cfg.python if os.sep in cfg.python else shutil.which(cfg.python)
        if found is None or not os.access(found, os.X_OK) or os.path.isdir(found):
            raise TrainerSetupError(
                f"the trainer's Python {cfg.python!r} (LORAFLEET_AGENT_PYTHON) is not an "
                "executable here; point it at an interpreter with torch and transformers, "
                "or unset it to use the newest vLLM's"
            )
        return found
    newest = engines.newest_vllm_python(cfg.engines_dir)
    if newest is None:
        raise TrainerSetupError(
            f"training needs vLLM installed on this node (its torch is what trains) and "
            f"there is none under {cfg.engines_dir / 'vllm'}: install one as "
            "<engines_dir>/vllm/<version> (serving any vLLM model here installs it), or set "
            "LORAFLEET_AGENT_PYTHON to an interpreter with torch and transformers"
        )
    return str(newest)


async def trainer_environment(cfg: AgentConfig) -> TrainerEnvironment:
    """What this agent's trainer runs in: the stand-in's environment when
    cfg.trainer is not the real trainer, else the engine's (`prepare`)."""
    if cfg.runs_standin:
        return StandinEnvironment()
    return await prepare(cfg)


async def prepare(cfg: AgentConfig) -> EngineEnvironment:
    """Find the Python, make sure its overlay is there, and settle the user.
    Raises TrainerSetupError when the node cannot train (no Python, the
    overlay does not install or import)."""
    python = find_python(cfg)
    user, notes = await settle_user(cfg, python)
    overlay = await ensure_overlay(cfg, python)
    home = user.home if user is not None else cfg.work_dir / "engine-home"
    if user is None:
        home.mkdir(parents=True, exist_ok=True)
    hf_home = Path(cfg.hf_home) if cfg.hf_home else home / ".cache" / "huggingface"
    return EngineEnvironment(
        python=python,
        pythonpath=(str(overlay),),
        user=user,
        home=home,
        hf_home=hf_home,
        notes=tuple(notes),
        hf_offline=cfg.hf_offline,
    )


def copy_trainer_package(parent: Path) -> Path:
    """The trainer package (lorafleet_trainer) copied into `parent` (a copy
    already there replaced); answers the copy. Copied, not run from where
    lorafleet is installed: the engines' user may not read lorafleet's
    environment, and the engine's Python must not see lorafleet's packages."""
    package = parent / lorafleet_trainer.__name__
    shutil.rmtree(package, ignore_errors=True)
    shutil.copytree(
        Path(lorafleet_trainer.__file__).parent,
        package,
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    return package
