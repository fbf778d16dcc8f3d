"""The agent's own settings (beside the shared `lorafleet.settings.Settings`).

Every field is `LORAFLEET_AGENT_<FIELD>` in the environment, or a
`lorafleet agent` option.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from lorafleet.names import check_token
from lorafleet.settings import SettingsError, read_env, write_env

#: What training needs besides the engine's Python, pinned. Installed with
#: --no-deps: their dependencies are the engine's own, and resolving them
#: would pull a second torch.
OVERLAY_PACKAGES: tuple[str, ...] = ("peft==0.21.2", "accelerate==1.15.0")

#: The hosts a server listening on every address is started with.
EVERY_ADDRESS = frozenset({"", "0.0.0.0", "::", "[::]"})

#: The engines' unprivileged user.
DEFAULT_RUN_AS = "lorafleet-engine"

#: Where llama.cpp's source is fetched from, by release tag ({tag}).
DEFAULT_CONVERSION_SOURCE = "https://github.com/ggml-org/llama.cpp/archive/refs/tags/{tag}.tar.gz"


#: A configured llama.cpp release tag: it becomes part of a path and a URL.
_LLAMACPP_TAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class LlamacppTagError(ValueError):
    """A configured llama.cpp release tag that cannot be one."""


def check_llamacpp_tag(tag: str, what: str) -> str:
    """`tag`, when it can name a llama.cpp release; else LlamacppTagError
    saying so (`what`: where it came from, e.g. the variable)."""
    if not _LLAMACPP_TAG_RE.fullmatch(tag):
        raise LlamacppTagError(
            f"{what}={tag!r} is not a llama.cpp release tag; use one like b4000 "
            "(letters, digits, '.', '_' and '-')"
        )
    return tag


class AgentConfigError(SettingsError):
    """An agent setting lorafleet cannot use (a SettingsError: the process
    exits 2 with one line, as for the shared settings)."""


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """How one node's agent works.

    node: the node's name, a subject-safe token.
    engines_dir: where engines are installed (`vllm/<version>/bin/python3`,
        `llamacpp/b<build>-...`); default /opt/lorafleet/engines.
    work_dir: the agent's own directory (overlay, conversion code, job dirs,
        the engines' user's home); default /var/lib/lorafleet/agent.
    run_as: the engines' unprivileged user; default "lorafleet-engine".
    allow_cpu: train on the CPU when the node has no card; default False
        (the embedded default turns it on).
    python: an explicit interpreter for the trainer; default: the newest vLLM's.
    wheel_dir: a local directory of wheels for the overlay (offline nodes).
    hf_home: the Hugging Face cache shared with the engines; default: the
        engines' user's home under work_dir.
    hf_offline: read base weights from the cache only; default False.
    llamacpp_tag: the llama.cpp release the node serves and converts with (a
        tag like b4000: letters, digits, ".", "_" and "-"); default: the newest
        installed under engines_dir/llamacpp.
    conversion_source: URL template ({tag}) or local file path template of
        llama.cpp's source tarball.
    trainer: "real" (the LoRA trainer) or "standin" (the protocol stand-in,
        for tests and dry runs); default "real". Or the absolute path of a
        script of one's own speaking the trainer protocol, run as the
        stand-in is (the agent's Python and user, a stand-in GGUF): a
        trainer a test needs that the stand-in does not offer.
    cancel_grace_s: seconds between SIGTERM and SIGKILL of the trainer's
        process group; default 5.
    chunk_bytes: artifact chunk body size; default 512 KiB.
    overlay_packages: the pinned packages training needs besides the
        engine's Python, installed into the overlay with --no-deps.
    vllm_servers: the vLLM servers on this node that serve adapters, each
        `URL` or `URL|API_KEY` (comma separated in the environment); default
        none: the agent scans the processes (`running_engines`).
    engines_refresh_s: seconds between re-reads of the running engines (the
        process scan and each engine's /v1/models); the heartbeat carries
        the last read, and an engine's restart is seen within this; default 5.
    llamacpp_adapters_dir: where the node's llama-server reads its adapters
        (`--lora <path>`); the agent puts each served GGUF there; default
        `<work_dir>/llamacpp-adapters`.
    advertise_host: the host name or address other hosts reach this node
        by: an engine listening on every address (0.0.0.0, ::, no --host)
        is reported there, for the gateway on another host; default none:
        127.0.0.1, right only when the gateway runs on this node.
    llamacpp_servers: the node's llama-servers whose load training yields
        to, each `URL` or `URL|slots` (read /slots: a server without
        --metrics); default none.
    yield_sample_s: seconds between two reads of the engines' /metrics
        (or /slots) while a job that yields to serving trains; default 0.1.
    yield_busy_requests: an engine with this many requests running or
        waiting, or at 1 new tokens, is busy: the trainer pauses; default 1.
    yield_idle_s: seconds every engine must have been idle before a paused
        trainer goes on (more than yield_sample_s: an engine's /metrics,
        read while it holds the pause, keep it through a quiet stretch of
        its server); default 0.15.
    yield_run_share: under load that never leaves yield_idle_s of quiet,
        the trainer still runs this share of each yield_period_s (0: it waits
        for quiet however long); default 0.25.
    yield_period_s: that duty cycle's period in seconds; default 4.
    yield_cpu_sample_s: seconds between two reads of the run time of an
        engine's server (/proc, for an engine whose process the agent
        sees: it costs the engine nothing); default 0.01.
    yield_busy_cpu_share: that server is busy when its main thread ran
        this share of a core since the last read (vLLM's at rest: under
        0.03); default 0.1.
    """

    node: str
    engines_dir: Path = Path("/opt/lorafleet/engines")
    work_dir: Path = Path("/var/lib/lorafleet/agent")
    run_as: str = DEFAULT_RUN_AS
    allow_cpu: bool = False
    python: str | None = None
    wheel_dir: str | None = None
    hf_home: str | None = None
    hf_offline: bool = False
    llamacpp_tag: str | None = None
    conversion_source: str = DEFAULT_CONVERSION_SOURCE
    trainer: str = "real"
    cancel_grace_s: float = 5.0
    chunk_bytes: int = 512 * 1024
    overlay_packages: tuple[str, ...] = field(default=OVERLAY_PACKAGES)
    vllm_servers: tuple[str, ...] = ()
    engines_refresh_s: float = 5.0
    llamacpp_adapters_dir: Path | None = None
    advertise_host: str | None = None
    llamacpp_servers: tuple[str, ...] = ()
    yield_sample_s: float = 0.1
    yield_busy_requests: int = 1
    yield_idle_s: float = 0.15
    yield_run_share: float = 0.25
    yield_period_s: float = 4.0
    yield_cpu_sample_s: float = 0.01
    yield_busy_cpu_share: float = 0.1

    def __post_init__(self) -> None:
        check_token(self.node, "node name")
        if self.trainer not in ("real", "standin") and not (
            Path(self.trainer).is_absolute() and self.trainer.endswith(".py")
        ):
            raise AgentConfigError(
                "LORAFLEET_AGENT_TRAINER must be 'real', 'standin' or the absolute path "
                f"of a trainer script (*.py), not {self.trainer!r}"
            )
        if self.cancel_grace_s < 0:
            raise AgentConfigError("LORAFLEET_AGENT_CANCEL_GRACE_S must be >= 0 seconds")
        if not 0.1 <= self.engines_refresh_s <= 3600:
            raise AgentConfigError(
                "LORAFLEET_AGENT_ENGINES_REFRESH_S must be 0.1 .. 3600 seconds, "
                f"not {self.engines_refresh_s:g}"
            )
        if self.advertise_host is not None and (
            not self.advertise_host.strip("[]") or self.advertise_host in EVERY_ADDRESS
        ):
            raise AgentConfigError(
                "LORAFLEET_AGENT_ADVERTISE_HOST must be the name or address other hosts "
                f"reach this node by, not {self.advertise_host!r}"
            )
        self._check_yield()
        if not 1024 <= self.chunk_bytes <= 8 * 1024 * 1024:
            raise AgentConfigError("LORAFLEET_AGENT_CHUNK_BYTES must be 1 KiB .. 8 MiB")
        if self.llamacpp_tag is not None:
            try:
                check_llamacpp_tag(self.llamacpp_tag, "LORAFLEET_AGENT_LLAMACPP_TAG")
            except LlamacppTagError as e:
                raise AgentConfigError(str(e)) from None

    def _check_yield(self) -> None:
        bounds = {
            "yield_sample_s": (0.01, 10.0),
            "yield_busy_requests": (1, 1_000_000),
            "yield_idle_s": (0.0, 3600.0),
            "yield_run_share": (0.0, 1.0),
            "yield_period_s": (0.1, 3600.0),
            "yield_cpu_sample_s": (0.001, 10.0),
            "yield_busy_cpu_share": (0.01, 1.0),
        }
        for name, (lo, hi) in bounds.items():
            value = getattr(self, name)
            if not lo <= value <= hi:
                raise AgentConfigError(
                    f"LORAFLEET_AGENT_{name.upper()} must be {lo:g} .. {hi:g}, not {value:g}"
                )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> AgentConfig:
        """Read `LORAFLEET_AGENT_*` variables; `overrides` (not None) win."""
        prefix = "LORAFLEET_AGENT_"
        values = read_env(cls, prefix, os.environ if env is None else env, AgentConfigError)
        values.update({k: v for k, v in overrides.items() if v is not None})
        if "node" not in values:
            raise AgentConfigError(
                "the agent needs a node name: --node NAME or LORAFLEET_AGENT_NODE"
            )
        return cls(**values)

    @property
    def runs_standin(self) -> bool:
        """The trainer is the stand-in, or a script run as the stand-in is."""
        return self.trainer != "real"

    @property
    def llamacpp_adapters(self) -> Path:
        """Where served GGUFs go (llamacpp_adapters_dir, or its default)."""
        return self.llamacpp_adapters_dir or self.work_dir / "llamacpp-adapters"

    @property
    def served_dir(self) -> Path:
        """The staged copies the engines read, and desired.json."""
        return self.work_dir / "served"

    def to_env(self) -> dict[str, str]:
        return write_env(self, "LORAFLEET_AGENT_")

    def with_(self, **changes: Any) -> AgentConfig:
        return replace(self, **changes)


@dataclass(frozen=True, slots=True)
class EngineUser:
    """The unprivileged user the trainer (like the engines) runs as."""

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    #: Its home under the agent's work directory: HF, XDG and Triton caches live there.
    home: Path

    def env(self) -> dict[str, str]:
        return {
            "HOME": str(self.home),
            "USER": self.name,
            "LOGNAME": self.name,
            "XDG_CACHE_HOME": str(self.home / ".cache"),
            "TRITON_CACHE_DIR": str(self.home / ".cache" / "triton"),
        }
