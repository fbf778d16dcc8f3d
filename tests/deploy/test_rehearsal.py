"""docs/deploy.md, rehearsed on a fleet of network namespaces.

docs/deploy.md's "Command by command" blocks, read from the page (so
the page cannot drift from what runs), deploy the control plane in a
namespace of its own: `lorafleet auth`, three NATS servers from compose's
members' config, PostgreSQL (the test server, reached through a relay on the
test's end of the control plane's veth), two recorders, two schedulers, the
artifact-store and the gateway. Two nodes join as "Nodes, beside their engines" says (the
unit's environment files, each node's own seed and advertised host), each
in a namespace of its own, beside an engine on the node's own address: the
real CPU vLLM on gpu-1, tests/gateway/engine.py (vLLM's interface in
miniature) on gpu-2. The namespaces are joined by veth pairs only; nothing
listens on or calls a loopback address.

Through the gateway, with the openai SDK: a job trains on gpu-1 (the real
trainer, in the vLLM's Python), is served there, and a chat reaches it at
gpu-1's address. Then every control-plane process and NATS server is
restarted, one at a time, while jobs (on gpu-2, the stand-in trainer) and
chats stream through the gateway: every job created ends succeeded, no
node is lost, and the chats that failed are counted by cause and by the
process restarting at the time. The figures are printed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import psycopg
import pytest
from openai import AsyncOpenAI

from lorafleet.nats.server import LAME_DUCK_STOP_GRACE_S, binary
from lorafleet.settings import Settings
from lorafleet_services.local import vllm_cpu
from lorafleet_services.local.tiny_model import VLLM_CPU_SIZES, build_tiny_model
from lorafleet_services.local.vllm_launch import running_vllm
from tests.cluster.test_agent_unit import (
    code_blocks,
    env_lines,
    systemd_environment,
    unit_settings,
    unit_text,
)
from tests.eventually import eventually
from tests.gateway import sdk_real
from tests.gateway.conftest import sdk_for
from tests.partition.netns import NetnsLink, available, join
from tests.pg import PG_ADMIN_DSN
from tests.procs import ServiceProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "deploy.md"
NODES = ("gpu-1", "gpu-2")
#: The engines' ports on their nodes (apart: the agent matches a configured
#: engine to a scanned vLLM process by port, and the scan sees every namespace).
ENGINE_PORTS = {"gpu-1": 8000, "gpu-2": 8001}
#: Seconds between two jobs, and two chats, of the streams during the restarts.
SUBMIT_GAP_S = 2.0
CHAT_GAP_S = 0.25
#: Seconds every job of the stream has to succeed after the last restart.
STREAM_JOBS_TIMEOUT_S = 300.0
#: Seconds a restarted NATS server has to report its JetStream current again.
NATS_HEALTHY_TIMEOUT_S = 60.0
#: Seconds a process has to say it is ready (a loaded machine: several services start at once).
START_TIMEOUT_S = 120.0
#: Seconds the setup block and the CLI commands may take.
COMMAND_TIMEOUT_S = 120.0
STANDIN_PAIRS = (
    b'{"messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]}\n'
)


def section_blocks() -> tuple[str, list[str]]:
    """The "Command by command" section's setup script, and its process lines."""
    section = DOC.read_text().split("### Command by command", 1)[1].split("\n## ", 1)[0]
    setup, processes = code_blocks(section)[:2]
    return setup, [line for line in processes.splitlines() if line.strip()]


class DocProcess(ServiceProcess):
    """A process of the page (`argv`), run in namespace `ns`: `ip netns exec`
    execs, and so does the line's shell, so the pid is the process's own."""

    def __init__(self, ns: str, label: str, argv: list[str], env: dict[str, str]) -> None:
        super().__init__(label, Settings(), env=env)
        self.ns, self.argv = ns, argv

    def command(self) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *self.argv]

    def is_ready(self, line: dict[str, Any] | None, text: str) -> bool:
        return super().is_ready(line, text) or "Server is ready" in text

    async def start(self, timeout_s: float = START_TIMEOUT_S) -> ServiceProcess:
        return await super().start(timeout_s)


@dataclass
class Fleet:
    cp: NetnsLink
    nodes: dict[str, NetnsLink]
    processes: list[DocProcess]
    agents: dict[str, DocProcess]
    gateway_url: str
    api_key: str
    vllm_url: str
    deploy_s: float


def on_this_machine(text: str, root: Path) -> str:
    """The page's paths, moved under the test's directory."""
    return text.replace("/etc/lorafleet", f"{root}/etc").replace(
        "/var/lib/lorafleet", f"{root}/var"
    )


def shell_env(root: Path, **more: str) -> dict[str, str]:
    path = f"{Path(sys.executable).parent}:{Path(binary()).parent}:{os.environ['PATH']}"
    return {**os.environ, "PATH": path, "HOME": str(root), **more}


def in_ns(ns: str, script: str, env: dict[str, str]) -> str:
    done = subprocess.run(
        ["ip", "netns", "exec", ns, "sh", "-e", "-c", script], cwd=REPO, env=env,
        capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False,
    )  # fmt: skip
    assert done.returncode == 0, f"{script}\nexited {done.returncode}:\n{done.stderr}"
    return done.stdout


def node_env(root: Path, node: str, link: NetnsLink, engine_url: str) -> dict[str, str]:
    """What systemd gives the node's agent (the page's unit and agent.env, the
    node's `lorafleet auth` env file), on this machine; and the rehearsal's
    own: its engine, its trainer, its engines directory, no index."""
    etc = root / node / "etc"
    etc.mkdir(parents=True)
    shutil.copy(root / "etc" / "identities" / "node" / f"{node}.nk", etc / "node.nk")
    unit = unit_text().replace("gpu-3", node)
    files = {f"/etc/lorafleet/node-{node}.env":
             (root / "etc" / "identities" / "env" / f"node-{node}.env").read_text()}  # fmt: skip
    for block in code_blocks(DOC.read_text()):
        if block.startswith("# /etc/lorafleet/agent.env"):
            files["/etc/lorafleet/agent.env"] = block
    env = systemd_environment(unit, files)
    env["LORAFLEET_NATS_NKEY_SEED"] = env["LORAFLEET_NATS_NKEY_SEED"].replace(
        "/etc/lorafleet", str(etc)
    )
    assert env["LORAFLEET_AGENT_ADVERTISE_HOST"] == "gpu-3.example"
    real = node == "gpu-1"
    return {
        **env,
        "LORAFLEET_AGENT_ADVERTISE_HOST": link.ns_ip,
        "LORAFLEET_AGENT_VLLM_SERVERS": engine_url,
        "LORAFLEET_AGENT_WORK_DIR": str(root / node / "work"),
        "LORAFLEET_AGENT_ENGINES_DIR": str(vllm_cpu.engines_cache() if real else root / "none"),
        "LORAFLEET_AGENT_TRAINER": "real" if real else "standin",
        "LORAFLEET_AGENT_ALLOW_CPU": "true",
        "LORAFLEET_AGENT_HF_OFFLINE": "true",
        "LORAFLEET_AGENT_ENGINES_REFRESH_S": "1",
        "LORAFLEET_AGENT_WHEEL_DIR": str(root / "wheels"),
    }


def agent_process(root: Path, node: str, link: NetnsLink, engine_url: str) -> DocProcess:
    unit = unit_text().replace("gpu-3", node)
    (exec_start,) = unit_settings(unit, "ExecStart")
    program, *args = exec_start.split()
    argv = [str(Path(sys.executable).parent / Path(program).name), *args]
    return DocProcess(link.ns, f"agent {node}", argv, node_env(root, node, link, engine_url))


@contextlib.contextmanager
def links() -> Iterator[tuple[NetnsLink, dict[str, NetnsLink]]]:
    reason = available()
    if reason is not None:
        pytest.skip(reason)
    made: list[NetnsLink] = []
    try:
        cp = NetnsLink().create()
        made.append(cp)
        nodes = {}
        for node in NODES:
            nodes[node] = NetnsLink().create()
            made.append(nodes[node])
            join(cp, nodes[node])
        yield cp, nodes
    finally:
        for link in made:
            link.delete()


@contextlib.contextmanager
def database(host: str) -> Iterator[str]:
    """An empty database on the test server, and a relay to it on `host`
    (the test's end of the control plane's veth): the recorders migrate it."""
    name = f"lorafleet_rehearsal_{os.getpid()}"
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    relay = subprocess.Popen(
        ["socat", f"TCP-LISTEN:5432,bind={host},reuseaddr,fork", "TCP:127.0.0.1:5432"]
    )
    try:
        yield f"postgresql+psycopg://postgres@{host}:5432/{name}"
    finally:
        relay.terminate()
        relay.wait(10)
        with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


async def deploy_control_plane(
    root: Path, cp: NetnsLink, database_url: str, processes: list[DocProcess]
) -> str:
    """The page's setup block, then its processes in order (into `processes`,
    as each starts); the API key the block made."""
    setup, lines = section_blocks()
    env = shell_env(root, CP=cp.ns_ip, DATABASE_URL=database_url)
    printed = await asyncio.to_thread(in_ns, cp.ns, on_this_machine(setup, root), env)
    for line in lines:
        assert line.startswith("(") and line.endswith(")"), line
        label = re.sub(r".*exec ", "", line[1:-1])
        argv = ["sh", "-c", on_this_machine(line[1:-1], root)]
        proc = DocProcess(cp.ns, label, argv, env)
        processes.append(proc)
        await proc.start()
    return printed.strip().splitlines()[-1]


async def cli(fleet_root: Path, cp: NetnsLink, *args: str) -> str:
    """`lorafleet ARGS` as the operators' client, in the control plane's namespace."""
    identity = f"{fleet_root}/etc/identities/env/client-cli.env"
    script = f"set -a; . {identity}; exec lorafleet {' '.join(args)}"
    return await asyncio.to_thread(in_ns, cp.ns, script, shell_env(fleet_root))


@contextlib.asynccontextmanager
async def fake_engine(link: NetnsLink, port: int) -> AsyncIterator[str]:
    proc = await asyncio.create_subprocess_exec(
        "ip", "netns", "exec", link.ns, sys.executable, "-m", "tests.gateway.engine",
        link.ns_ip, str(port), stdout=asyncio.subprocess.PIPE, cwd=REPO,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        yield line.decode().split()[-1]
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        await proc.wait()


def overlay_wheels(into: Path) -> None:
    """The trainer's overlay as an offline node gets it (docs/deploy.md, "Nodes"):
    the nodes' namespaces reach no index."""
    from lorafleet_services.agent.config import OVERLAY_PACKAGES

    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(into),
         *OVERLAY_PACKAGES], check=True, timeout=COMMAND_TIMEOUT_S,
    )  # fmt: skip


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[Fleet]:
    engines = vllm_cpu.engines_cache()
    if not vllm_cpu.installed(engines):
        pytest.fail(f"no vLLM in {engines}: run `./dev install-test` once")
    root = tmp_path
    await asyncio.to_thread(overlay_wheels, root / "wheels")
    model_dir = build_tiny_model("llama", root / "tiny-llama", sizes=VLLM_CPU_SIZES)
    processes: list[DocProcess] = []
    agents: dict[str, DocProcess] = {}
    with links() as (cp, nodes), database(cp.host_ip) as db_url, contextlib.ExitStack() as ex:
        n1 = nodes["gpu-1"]
        vllm = asyncio.create_task(asyncio.to_thread(ex.enter_context, running_vllm(
            vllm_cpu.vllm_cpu_python(engines), model_dir, root / "vllm.log",
            port=ENGINE_PORTS["gpu-1"], host=n1.ns_ip, prefix=["ip", "netns", "exec", n1.ns],
        )))  # fmt: skip
        try:
            started = time.monotonic()
            key = await deploy_control_plane(root, cp, db_url, processes)
            deploy_s = time.monotonic() - started
            await cli(root, cp, "models", "add", "tiny-llama", "--engine", "vllm",
                      "--local-dir", str(model_dir))  # fmt: skip
            async with fake_engine(nodes["gpu-2"], ENGINE_PORTS["gpu-2"]) as engine_2:
                served = await vllm
                for node, url in (("gpu-1", served.url), ("gpu-2", engine_2)):
                    agents[node] = agent_process(root, node, nodes[node], url)
                    await agents[node].start()
                written = env_lines((root / "etc" / "control-plane.env").read_text())
                port = written["LORAFLEET_GATEWAY_ADDR"].rsplit(":", 1)[1]
                gateway_url = f"http://{cp.ns_ip}:{port}"
                yield Fleet(cp, nodes, processes, agents, gateway_url, key,
                            served.url, deploy_s)  # fmt: skip
        finally:
            for proc in [*agents.values(), *reversed(processes)]:
                await proc.stop()
            # Not cancelled: a start under way ends, and the ExitStack stops it.
            with contextlib.suppress(BaseException):
                await vllm


@dataclass
class Stream:
    """What the streams met during the restarts: counts, and failures by cause
    and by the process restarting when they failed."""

    restarting: str = "none"
    jobs: list[str] = field(default_factory=list)
    chats_ok: int = 0
    failures: Counter[tuple[str, str, str]] = field(default_factory=Counter)

    def failed(self, kind: str, e: Exception) -> None:
        cause = type(e).__name__
        if isinstance(e, openai.APIStatusError):
            cause = f"{cause} {e.status_code}: {e.message[:80]}"
        self.failures[(kind, cause, self.restarting)] += 1


async def submits(sdk: AsyncOpenAI, stream: Stream, stop: asyncio.Event) -> None:
    """A job on gpu-2 every SUBMIT_GAP_S: its file uploaded, then the job created."""
    for _ in range(10_000):
        if stop.is_set():
            return
        step = "upload"
        try:
            uploaded = await sdk.files.create(file=("one.jsonl", STANDIN_PAIRS),
                                              purpose="fine-tune")  # fmt: skip
            step = "submit"
            job = await sdk.fine_tuning.jobs.create(
                model="tiny-llama", training_file=uploaded.id,
                extra_body={"lorafleet": {"node": "gpu-2", "gpu_memory_mib": 1000,
                                          "max_steps": 2}},
            )  # fmt: skip
            stream.jobs.append(job.id)
        except openai.OpenAIError as e:
            stream.failed(step, e)
        await asyncio.sleep(SUBMIT_GAP_S)


async def chats(sdk: AsyncOpenAI, model: str, stream: Stream, stop: asyncio.Event) -> None:
    for _ in range(100_000):
        if stop.is_set():
            return
        try:
            await sdk.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "2+2?"}], max_tokens=4
            )
            stream.chats_ok += 1
        except openai.OpenAIError as e:
            stream.failed("chat", e)
        await asyncio.sleep(CHAT_GAP_S)


def nats_healthy(fleet: Fleet, member: str) -> bool:
    import urllib.request

    port = 8221 + int(member.rsplit("-", 1)[1])
    url = f"http://{fleet.cp.ns_ip}:{port}/healthz"
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


async def rolling_restart(fleet: Fleet, stream: Stream) -> None:
    for proc in fleet.processes:
        found = re.search(r"nats/(nats-\d)\.env", " ".join(proc.argv))
        member = found.group(1) if found else None
        stream.restarting = member or proc.module
        if member is None:
            await proc.stop()
        else:  # as compose stops a member: lame-duck mode (docs/deploy.md)
            await proc.stop(timeout_s=LAME_DUCK_STOP_GRACE_S, signum=signal.SIGUSR2)
        await proc.start()
        if member is not None:
            await eventually(
                functools.partial(asyncio.to_thread, nats_healthy, fleet, member),
                f"{member} healthy", timeout_s=NATS_HEALTHY_TIMEOUT_S,
            )  # fmt: skip
        # Failures until the next restart are counted against this one (its
        # clients reconnecting), while the streams run with every process up.
        stream.restarting = f"after {stream.restarting}"
        await asyncio.sleep(2.0)


async def test_the_guides_deployment_serves_through_a_rolling_restart(fleet: Fleet) -> None:
    print(f"control plane deployed in {fleet.deploy_s:.1f} s ({len(fleet.processes)} processes)")
    async with sdk_for(fleet.gateway_url, fleet.api_key) as sdk:
        started = time.monotonic()
        # Succeeded means usable: the one chat sent right after it is answered.
        job, answer = await sdk_real.trained(sdk, "gpu-1", rank=4)
        model = job.fine_tuned_model or ""
        print(f"gpu-1's job succeeded and served in {time.monotonic() - started:.1f} s")
        assert answer
        listed = {m.id: m.model_extra or {} for m in (await sdk.models.list()).data}
        # The gateway calls gpu-1's engine at gpu-1's own address.
        assert listed[model]["served_by"] == [f"{fleet.vllm_url}/v1"], listed
        assert fleet.nodes["gpu-1"].ns_ip in fleet.vllm_url

        stream, stop = Stream(), asyncio.Event()
        tasks = [asyncio.create_task(submits(sdk, stream, stop)),
                 asyncio.create_task(chats(sdk, model, stream, stop))]  # fmt: skip
        try:
            rolled = time.monotonic()
            await rolling_restart(fleet, stream)
            roll_s = time.monotonic() - rolled
        finally:
            stop.set()
            await asyncio.gather(*tasks)

        # Every job there is, those whose create failed on the way back included.
        known = {j.id async for j in sdk.fine_tuning.jobs.list(limit=100)}
        assert set(stream.jobs) <= known, set(stream.jobs) - known
        ends = [
            await eventually(
                functools.partial(sdk.fine_tuning.jobs.retrieve, j),
                f"{j} to end",
                until=lambda r: r.status in sdk_real.FINAL,
                timeout_s=STREAM_JOBS_TIMEOUT_S,
            )
            for j in sorted(known)
        ]
        # What ended otherwise, with why: its error and its last events.
        unfinished = [
            (
                j.id,
                j.status,
                j.error,
                [e.message async for e in sdk.fine_tuning.jobs.list_events(j.id, limit=8)],
            )
            for j in ends
            if j.status != "succeeded"
        ]
    print(f"rolling restart of {len(fleet.processes)} processes in {roll_s:.1f} s: "
          f"{len(stream.jobs)} jobs created ({len(known) - 1 - len(stream.jobs)} more "
          f"whose create failed), {stream.chats_ok} chats answered; failures: "
          f"{dict(stream.failures) or 'none'}")  # fmt: skip
    for proc in fleet.processes:  # what the services said went wrong, for the record
        told = [ln for ln in proc.lines if ln.get("level") in ("warning", "error")]
        print(f"{proc.module}: {len(told)} warnings and errors", *told[-5:], sep="\n  ")
    assert stream.jobs and stream.chats_ok
    assert not unfinished, "\n".join(map(repr, unfinished))  # whole: the reason is at its end
    lost = [ln for p in fleet.processes for ln in p.events("node.lost")]
    fenced = [ln for a in fleet.agents.values() for ln in a.events("agent.fenced")]
    assert lost == [] and fenced == [], (lost, fenced)
    # A chat fails only while the one gateway is down (refused: none was mid-stream).
    elsewhere = {k: n for k, n in stream.failures.items()
                 if k[0] == "chat" and k[2] != "lorafleet gateway"}  # fmt: skip
    assert elsewhere == {}, elsewhere
