"""The vLLM servers running on this node, and what each allows for LoRA.

The configured servers (`AgentConfig.vllm_servers`), else a psutil scan for
vLLM's OpenAI server processes, whose command lines are read as vLLM's own
parser reads them, with vLLM's defaults for the flags not given, and whose
environment says whether runtime loading is on (None: unknown, left to the
engine's answer). `parse_server_argv` and `runtime_updating` are pure;
`scan_vllm_processes` and `running_vllm_servers` read /proc. The flags and
their defaults an operator sets: docs/deploy.md (nodes). A server
listening on every address is reported at the node's advertised host
(`AgentConfig.advertise_host`), else at 127.0.0.1: the URL goes into the
heartbeat, and a gateway on another host calls it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from urllib.parse import urlsplit

import psutil

from lorafleet_services.agent.config import EVERY_ADDRESS

API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
DEFAULT_PORT = 8000
#: Where a server listening on every address is called when the node
#: advertises no host of its own.
LOOPBACK = "127.0.0.1"
DEFAULT_MAX_LORA_RANK = 16
DEFAULT_MAX_LORAS = 1
RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"

#: Flags that take no value; every other flag this module reads takes one.
_BOOLEAN_FLAGS = frozenset({"enable-lora"})
#: Flags whose value is one or more words (argparse nargs="+").
_MANY_VALUED_FLAGS = frozenset({"served-model-name"})


@dataclass(frozen=True, slots=True)
class VllmServer:
    """One running vLLM server as the agent knows it.

    url: where to call it (`http://host:port`; a server listening on every
        address is called at the node's advertised host, else 127.0.0.1).
    model: its `--model` (a path or a hub id); None when unknown.
    served_names: `--served-model-name`'s names (default: the model); the
        first is the name requests and `/v1/models` use.
    enable_lora, max_lora_rank, max_loras, max_cpu_loras: its LoRA flags
        (None: unknown, a configured server the scan did not find).
    runtime_updating: VLLM_ALLOW_RUNTIME_LORA_UPDATING is on; None: unknown.
    pid: the process, when found by the scan.
    """

    url: str
    api_key: str | None = None
    model: str | None = None
    served_names: tuple[str, ...] = ()
    enable_lora: bool | None = None
    max_lora_rank: int | None = None
    max_loras: int | None = None
    max_cpu_loras: int | None = None
    runtime_updating: bool | None = None
    pid: int | None = None

    @property
    def base_name(self) -> str | None:
        """The name the base model is served under (requests' `model`)."""
        return self.served_names[0] if self.served_names else self.model

    @property
    def port(self) -> int | None:
        return urlsplit(self.url).port


def is_vllm_server(argv: Sequence[str]) -> bool:
    """The command line runs vLLM's OpenAI server (`-m` module or `vllm serve`)."""
    return _flags_start(argv) is not None


def parse_server_argv(
    argv: Sequence[str], env: Mapping[str, str] | None = None, advertise_host: str | None = None
) -> VllmServer:
    """A vLLM server's settings from its command line (and environment, when
    given: None means it could not be read). A server listening on every
    address (vLLM's default) is at `advertise_host`, else 127.0.0.1. Raises
    ValueError when `argv` is no vLLM server's."""
    start = _flags_start(argv)
    if start is None:
        raise ValueError(f"not a vLLM server command line: {' '.join(argv)[:200]}")
    positional, flags = _split_flags(argv[start:])
    model = flags.get("model") or (positional[0] if positional else None)
    host = flags.get("host", "")
    if host in EVERY_ADDRESS:
        host = advertise_host or LOOPBACK
    names = tuple(flags["served-model-name"].split()) if "served-model-name" in flags else ()
    max_loras = int(flags.get("max-loras", DEFAULT_MAX_LORAS))
    cpu_loras = flags.get("max-cpu-loras")
    api_key = flags.get("api-key") or (env or {}).get("VLLM_API_KEY") or None
    return VllmServer(
        url=f"http://{_bracketed(host)}:{int(flags.get('port', DEFAULT_PORT))}",
        api_key=api_key,
        model=model,
        served_names=names or ((model,) if model else ()),
        enable_lora=flags.get("enable-lora") == "true",
        max_lora_rank=int(flags.get("max-lora-rank", DEFAULT_MAX_LORA_RANK)),
        max_loras=max_loras,
        max_cpu_loras=int(cpu_loras) if cpu_loras is not None else max_loras,
        runtime_updating=None if env is None else runtime_updating(env),
    )


def runtime_updating(env: Mapping[str, str]) -> bool:
    """vLLM's own reading of VLLM_ALLOW_RUNTIME_LORA_UPDATING ("1"/"true", any case)."""
    return env.get(RUNTIME_UPDATING_ENV, "0").strip().lower() in ("1", "true")


def _flags_start(argv: Sequence[str]) -> int | None:
    """Where the server's own arguments begin, or None when it is no vLLM server."""
    for i, word in enumerate(argv):
        if word == "-m" and i + 1 < len(argv) and argv[i + 1] == API_SERVER_MODULE:
            return i + 2
        if word == f"-m{API_SERVER_MODULE}":
            return i + 1
        if word.rsplit("/", 1)[-1] == "vllm" and i + 1 < len(argv) and argv[i + 1] == "serve":
            return i + 2
    return None


def _split_flags(words: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """Positional words, and flag name (dashes) -> value ("true"/"false" for booleans)."""
    positional: list[str] = []
    flags: dict[str, str] = {}
    i = 0
    while i < len(words):
        word = words[i]
        i += 1
        if not word.startswith("--"):
            positional.append(word)
            continue
        name, eq, value = word[2:].partition("=")
        name = name.replace("_", "-")
        if name.startswith("no-") and name[3:] in _BOOLEAN_FLAGS:
            flags[name[3:]] = "false"
        elif name in _BOOLEAN_FLAGS:
            flags[name] = value.lower() if eq else "true"
        elif eq:
            flags[name] = value
        elif name in _MANY_VALUED_FLAGS:
            taken = []
            while i < len(words) and not words[i].startswith("-"):
                taken.append(words[i])
                i += 1
            flags[name] = " ".join(taken)
        elif i < len(words):
            flags[name] = words[i]
            i += 1
    return positional, flags


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def scan_vllm_processes(advertise_host: str | None = None) -> list[VllmServer]:
    """Every vLLM server process on this host, one per URL (a server's worker
    processes retitle themselves and do not match)."""
    found: dict[str, VllmServer] = {}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        argv = proc.info.get("cmdline") or []
        if not is_vllm_server(argv):
            continue
        try:
            env: Mapping[str, str] | None = proc.environ()
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            env = None
        server = replace(parse_server_argv(argv, env, advertise_host), pid=proc.info["pid"])
        found.setdefault(server.url, server)
    return list(found.values())


def parse_configured(entries: Iterable[str]) -> list[VllmServer]:
    """Configured servers: `URL` or `URL|API_KEY` each."""
    servers = []
    for entry in entries:
        url, _, key = entry.partition("|")
        servers.append(VllmServer(url=url.strip().rstrip("/"), api_key=key.strip() or None))
    return servers


def running_vllm_servers(
    configured: Sequence[str] = (), advertise_host: str | None = None
) -> list[VllmServer]:
    """The configured servers (with the scan's flags where it finds them on
    the same port), or, when none is configured, what the scan finds."""
    scanned = scan_vllm_processes(advertise_host)
    if not configured:
        return scanned
    by_port = {s.port: s for s in scanned}
    merged = []
    for server in parse_configured(configured):
        local = urlsplit(server.url).hostname in (LOOPBACK, "localhost", "::1", advertise_host)
        match = by_port.get(server.port) if local else None
        if match is None:
            merged.append(server)
        else:
            merged.append(replace(match, url=server.url, api_key=server.api_key or match.api_key))
    return merged


def llama_server_running() -> bool:
    """A llama.cpp server (`llama-server`) runs on this host."""
    for proc in psutil.process_iter(["cmdline"]):
        argv = proc.info.get("cmdline") or []
        if argv and argv[0].rsplit("/", 1)[-1] == "llama-server":
            return True
    return False
