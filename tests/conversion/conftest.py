"""Fixtures for the GGUF conversion tests.

- `release_tarball`: llama.cpp b11312's source as a release tarball, made
  once from llama-cpp-python 0.3.36's sdist (see llamacpp_source.py).
- `source_server`: a local HTTP server (127.0.0.1, a thread) serving files by
  name and recording each request, so the agent's real fetch runs.
- `fetched`: an AgentConfig whose work_dir already holds the conversion code,
  fetched once per session through `source_server`.
- `tiny`: the tiny Llama and Qwen2 (services/lorafleet_services/local/tiny_model.py) with a real
  PEFT LoRA adapter each; `converted`: each adapter converted once by
  `convert_to_gguf`, with an interpreter wrapper that records how it was run.
"""

from __future__ import annotations

import asyncio
import http.server
import shutil
import stat
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from lorafleet_services.agent.config import AgentConfig
from lorafleet_services.agent.environment.environments import EngineEnvironment
from lorafleet_services.agent.environment.gguf_conversion import (
    convert_to_gguf,
    ensure_conversion_code,
)
from lorafleet_services.local.tiny_model import build_tiny_model
from tests.conversion import llamacpp_source
from tests.conversion.adapters import make_adapter

ARCHES = ("llama", "qwen2")


@dataclass
class SourceServer:
    """Files served at http://127.0.0.1:<port>/<name>; `requests` lists each path asked for."""

    port: int
    files: dict[str, Path] = field(default_factory=dict)
    requests: list[str] = field(default_factory=list)

    def template(self) -> str:
        return f"http://127.0.0.1:{self.port}/{{tag}}.tar.gz"

    def serve(self, name: str, path: Path) -> None:
        self.files[name] = path


def _handler(server: SourceServer) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            name = self.path.lstrip("/")
            server.requests.append(name)
            path = server.files.get(name)
            if path is None:
                self.send_error(404, "no such release")
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/gzip")
            self.send_header("Content-Length", str(path.stat().st_size))
            self.end_headers()
            with path.open("rb") as f:
                shutil.copyfileobj(f, self.wfile)

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Handler


@pytest.fixture(scope="session")
def release_tarball() -> Path:
    return llamacpp_source.release_tarball()


@pytest.fixture(scope="session")
def source_server(release_tarball: Path) -> Iterator[SourceServer]:
    server = SourceServer(port=0)
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(server))
    server.port = httpd.server_address[1]
    server.serve(f"{llamacpp_source.TAG}.tar.gz", release_tarball)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture(scope="session")
def fetched(source_server: SourceServer, tmp_path_factory: pytest.TempPathFactory) -> AgentConfig:
    """An AgentConfig (llamacpp_tag b11312) whose work_dir holds the fetched code."""
    root = tmp_path_factory.mktemp("fetched")
    cfg = AgentConfig(
        node="node-1",
        engines_dir=root / "engines",
        work_dir=root / "work",
        llamacpp_tag=llamacpp_source.TAG,
        conversion_source=source_server.template(),
        cancel_grace_s=1.0,
    )
    asyncio.run(ensure_conversion_code(cfg, llamacpp_source.TAG))
    return cfg


@dataclass(frozen=True)
class Tiny:
    base: Path
    adapter: Path


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tiny]:
    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for arch in ARCHES:
        base = build_tiny_model(arch, root / arch)  # type: ignore[arg-type]
        out[arch] = Tiny(base=base, adapter=make_adapter(base, root / f"{arch}-lora"))
    return out


def environment(root: Path, python: str = sys.executable) -> EngineEnvironment:
    """The real trainer environment, running as the agent's own user with `python`."""
    return EngineEnvironment(
        python=python,
        pythonpath=(str(root / "overlay"),),
        user=None,
        home=root / "home",
        hf_home=root / "hf",
        notes=(),
    )


def recording_python(path: Path, record: Path) -> str:
    """An interpreter wrapper (a real executable) that writes its argv and
    PYTHONPATH into `record`, then runs this venv's Python with them."""
    path.write_text(
        "#!/bin/sh\n"
        f'printf "%s\\n" "PYTHONPATH=$PYTHONPATH" "HF_HUB_OFFLINE=$HF_HUB_OFFLINE" '
        f'"CWD=$(pwd)" "$@" > "{record}"\n'
        f'exec "{sys.executable}" "$@"\n'
    )
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return str(path)


@dataclass(frozen=True)
class Converted:
    gguf: Path
    #: What the interpreter wrapper saw: PYTHONPATH=, HF_HUB_OFFLINE=, CWD=, then argv.
    record: list[str]
    overlay: str


@pytest.fixture(scope="session")
def converted(
    fetched: AgentConfig, tiny: dict[str, Tiny], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Converted]:

    async def convert(arch: str) -> Converted:
        root = tmp_path_factory.mktemp(f"convert-{arch}")
        record = root / "record.txt"
        env = environment(root, recording_python(root / "python", record))
        gguf = await convert_to_gguf(
            fetched, env, tiny[arch].adapter, tiny[arch].base, root / "out" / "adapter.gguf"
        )
        return Converted(
            gguf=gguf, record=record.read_text().splitlines(), overlay=env.pythonpath[0]
        )

    async def both() -> list[Converted]:
        # At once: each converter's imports are most of its time, and there are two cores.
        return await asyncio.gather(*(convert(arch) for arch in ARCHES))

    return dict(zip(ARCHES, asyncio.run(both()), strict=True))


def processes_mentioning(text: str) -> list[int]:
    """Pids of running processes with `text` in their command line."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text.encode() in cmdline and state != "Z":
            out.append(int(entry.name))
    return out
