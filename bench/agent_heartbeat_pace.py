"""The agent's heartbeat pace while its trainer runs flat out.

    .venv/bin/python bench/agent_heartbeat_pace.py [--seconds 10]

A real nats-server and a real agent process (stand-in trainer). The gaps
between heartbeats, as a KV watcher receives them, are measured in three
phases of the same run:

- idle: the agent runs no job (the baseline);
- flood: the stand-in prints step lines with no pause, each one a JetStream
  publish on the agent's connection;
- cpu: the stand-in runs slowly while one CPU-burning process per core
  keeps the machine busy.

Printed: median, p99 and worst gap per phase, and each as a ratio to the
idle phase. The scheduler declares a node lost after node_timeout_s
(default 3 s) without a beat; the worst gap must stay well below that.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec

from lorafleet import log
from lorafleet.nats import _bus as bus
from lorafleet.nats.server import NatsServer
from lorafleet.settings import Settings
from lorafleet_schemas.messages import (
    ArtifactKind,
    Engine,
    Heartbeat,
    ModelRecord,
    StartReply,
    StartRequest,
    TrainerParams,
)
from lorafleet_services.agent.config import AgentConfig
from lorafleet_services.stack import ServiceProcess


def start_request(job_id: str, dataset: str, sha: str) -> StartRequest:
    import datetime as dt

    return StartRequest(
        job_id=job_id,
        attempt=1,
        model=ModelRecord(
            name="tiny", engine=Engine.VLLM, hf_repo=None, hf_revision="main",
            local_dir="/models/tiny", description="", created_at=dt.datetime.now(dt.UTC),
        ),
        gpu_memory_mib=1,
        dataset=dataset,
        dataset_sha256=sha,
        params=TrainerParams(),
        artifacts=[ArtifactKind.PEFT],
    )  # fmt: skip


def stats(gaps: list[float]) -> tuple[float, float, float]:
    s = sorted(gaps)
    p99 = s[min(len(s) - 1, round(0.99 * (len(s) - 1)))]
    return statistics.median(s), p99, s[-1]


async def phase(
    beats: list[tuple[float, str | None]], seconds: float, job: str | None
) -> list[float]:
    start = len(beats)
    await asyncio.sleep(seconds)
    times = [t for t, j in beats[start:] if j == job]
    return [b - a for a, b in itertools.pairwise(times)]


async def main(seconds: float) -> None:
    log.configure("bench", "warning")
    with tempfile.TemporaryDirectory() as tmp:
        server = NatsServer(Path(tmp) / "nats")
        await server.start()
        settings = Settings(nats_url=server.url, data_dir=tmp)
        nc = await bus.connect(settings, "bench")
        js = nc.jetstream()
        await bus.ensure_layout(js, bus.layout_for(settings))
        steps = 1_000_000
        cfg = AgentConfig(node="bench", work_dir=Path(tmp) / "agent", trainer="standin",
                          allow_cpu=True, cancel_grace_s=1)  # fmt: skip
        agents: list[ServiceProcess] = []
        burners: list[subprocess.Popen[bytes]] = []
        data = b'{"q": "1+1?", "a": "2"}\n' * 10
        sha = hashlib.sha256(data).hexdigest()
        await (await js.object_store(settings.names.datasets_bucket)).put("d", data)
        kv = await js.key_value(settings.names.nodes_bucket)
        watcher = await kv.watch("bench")
        beats: list[tuple[float, str | None]] = []
        loop = asyncio.get_running_loop()

        async def watch() -> None:
            while True:
                e = await watcher.updates(timeout=30)
                if e is not None and e.operation is None:
                    beats.append((loop.time(), msgspec.json.decode(e.value, type=Heartbeat).job))

        watching = asyncio.create_task(watch())
        results: dict[str, list[float]] = {}
        try:
            for name, env in (
                ("flood", {"LORAFLEET_STANDIN_STEPS": str(steps), "LORAFLEET_STANDIN_STEP_S": "0"}),
                ("cpu", {"LORAFLEET_STANDIN_STEPS": str(steps), "LORAFLEET_STANDIN_STEP_S": "0.5"}),
            ):
                agent = ServiceProcess("lorafleet_services.agent", settings,
                                       env={**cfg.to_env(), **env})  # fmt: skip
                agents.append(agent)
                await agent.start()
                if "idle" not in results:
                    results["idle"] = await phase(beats, seconds, None)
                reply = await bus.request(nc, settings.names.node_start("bench"),
                                          start_request(name, "d", sha), StartReply)  # fmt: skip
                assert reply.accepted, reply
                if name == "cpu":
                    burners = [
                        # Not awaited: the burners run beside the phase, killed after it.
                        subprocess.Popen([sys.executable, "-c", "while True: pass"])  # noqa: ASYNC220
                        for _ in range(os.cpu_count() or 1)
                    ]
                results[name] = await phase(beats, seconds, name)
                for b in burners:
                    b.kill()
                    b.wait()
                burners = []
                await agent.stop()
        finally:
            watching.cancel()
            for b in burners:
                b.kill()
            for a in agents:
                await a.stop()
            await nc.close()
            await server.stop()

    idle_med, _, idle_max = stats(results["idle"])
    print(f"heartbeat_s={settings.heartbeat_s:g}  node_timeout_s={settings.node_timeout_s}"
          f"  {seconds:g} s per phase  ({time.strftime('%Y-%m-%d %H:%M')})")  # fmt: skip
    print(f"{'phase':<6} {'beats':>5} {'median s':>9} {'p99 s':>7} {'worst s':>8}  ratio to idle")
    for name, gaps in results.items():
        med, p99, worst = stats(gaps)
        print(f"{name:<6} {len(gaps) + 1:>5} {med:>9.3f} {p99:>7.3f} {worst:>8.3f}  "
              f"median x{med / idle_med:.2f}, worst x{worst / idle_max:.2f}")  # fmt: skip


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=10.0, help="length of each phase")
    asyncio.run(main(ap.parse_args().seconds))
