"""What routing by the serving records costs a completion through the gateway,
against routing by LORAFLEET_GATEWAY_ENGINES (the baseline), and against the
engine asked directly, all in one run.

    .venv/bin/python bench/gateway_routing.py [--requests 300]

On one machine: a nats-server, the recorder (SQLite) and the scheduler as
processes, the gateway as a process with the engine in
LORAFLEET_GATEWAY_ENGINES, and the small engine of tests/gateway/engine.py
(it answers at once: what is measured is the relay and the routing). One
job is served there as the agent would leave it: its adapter loaded under
its served name, a ServingReport (served) on the status stream, and a node
whose heartbeat lists the engine. Three requests alternate: the engine
directly (the served name), the gateway by the configured engines (the
base, `tiny`), and the gateway by the serving records (the fine-tuned
name, rewritten to the served name). Printed: p50 and p99 of each, and the
records' routing against the configured engines' at both (target: within
10% of the gateway's overhead, since the view is cached).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import tempfile
import time
from pathlib import Path

import httpx2

from gateway import percentile, start_engine
from lorafleet.client import Client
from lorafleet.nats import _bus as bus
from lorafleet.nats.server import NatsServer
from lorafleet.settings import Settings
from lorafleet_schemas.messages import (
    Engine,
    EngineRef,
    Heartbeat,
    JobSpec,
    ModelSpec,
    ServingReport,
    ServingState,
)
from lorafleet_services.gateway.api_keys import make_key
from lorafleet_services.gateway.config import API_KEYS_FILE_NAME
from lorafleet_services.gateway.openai_shapes import Hyperparameters
from lorafleet_services.gateway.state import GatewayState, JobFields
from lorafleet_services.stack import ServiceProcess

NODE = "bench-1"
QA = '{"q": "2+2?", "a": "4"}\n'


def chat(model: str) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": "what is 2+2?"}]}


async def beat(lf: Client, settings: Settings, engine_url: str) -> None:
    started = dt.datetime.now(dt.UTC)
    engine = EngineRef(kind=Engine.VLLM, url=engine_url, model="tiny")
    while True:
        hb = Heartbeat(node=NODE, version="bench", started_at=started,
                       time=dt.datetime.now(dt.UTC), serving=[engine])  # fmt: skip
        await lf.js.publish(
            settings.names.node_heartbeat(NODE), bus.encode(hb), msg_ttl=settings.node_timeout_s
        )
        await asyncio.sleep(settings.heartbeat_s)


async def serve_one(lf: Client, settings: Settings, direct: str) -> tuple[str, str]:
    """A job served on the engine as the agent leaves it: (fine-tuned name, served name)."""
    await lf.add_model(
        ModelSpec(name="tiny", engine=Engine.VLLM, local_dir="/models/tiny"),
        read_architecture=False,
    )
    job = await lf.submit(JobSpec(model="tiny", gpu_memory_mib=100, data=QA))
    # The bench key's project owns it, as if made through the gateway (tenancy.py).
    state = await GatewayState.open(lf.js, settings.names.gateway_bucket)
    fields = JobFields(
        job_id=job.id, model="tiny", training_file="file-bench", seed=0,
        hyperparameters=Hyperparameters(), created_at=job.created_at,
    )  # fmt: skip
    await state.put_job("bench", fields)
    served = f"{job.id}-{'c' * 12}"
    async with httpx2.AsyncClient() as http:
        loaded = await http.post(
            f"{direct}/load_lora_adapter", json={"lora_name": served, "lora_path": "/x"}
        )
        loaded.raise_for_status()
    report = ServingReport(
        job_id=job.id, node=NODE, engine=direct.removesuffix("/v1"), engine_kind=Engine.VLLM,
        model="tiny", served_name=served, sha256="c" * 64, state=ServingState.SERVED, seq=1,
        time=dt.datetime.now(dt.UTC),
    )  # fmt: skip
    await lf.js.publish(settings.names.serving_report(NODE, job.id), bus.encode(report))
    return f"ft:tiny::{job.id}", served


async def measure(
    direct: str, via: str, key: str, tuned: str, served: str, n: int
) -> dict[str, list[float]]:
    ways = {"direct": (direct, served), "by engines": (via, "tiny"), "by records": (via, tuned)}
    times: dict[str, list[float]] = {w: [] for w in ways}
    auth = {"authorization": f"Bearer {key}"}
    async with httpx2.AsyncClient() as a, httpx2.AsyncClient(headers=auth) as b:
        deadline = time.monotonic() + 30
        while (await b.post(f"{via}/chat/completions", json=chat(tuned))).status_code != 200:
            assert time.monotonic() < deadline, "the gateway never routed the fine-tuned name"
            await asyncio.sleep(0.2)
        for _ in range(20):  # warm every connection and view
            for way, (base, model) in ways.items():
                await (a if way == "direct" else b).post(
                    f"{base}/chat/completions", json=chat(model)
                )
        for _ in range(n):
            for way, (base, model) in ways.items():
                http = a if way == "direct" else b
                t0 = time.perf_counter()
                reply = await http.post(f"{base}/chat/completions", json=chat(model))
                times[way].append(time.perf_counter() - t0)
                assert reply.status_code == 200, reply.text
                assert reply.json()["choices"][0]["message"]["content"].startswith(
                    served if way != "by engines" else "tiny"
                ), reply.text
    return times


async def main(n: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        async with NatsServer(Path(tmp) / "store") as server:
            settings = Settings(nats_url=server.url, data_dir=tmp)
            key = make_key(Path(tmp) / API_KEYS_FILE_NAME, "bench")
            engine, direct = await start_engine()
            env = {"LORAFLEET_GATEWAY_ADDR": "127.0.0.1:0", "LORAFLEET_GATEWAY_ENGINES": direct}
            procs = [
                ServiceProcess("lorafleet_services.recorder", settings),
                ServiceProcess("lorafleet_services.scheduler", settings),
                ServiceProcess("lorafleet_services.gateway", settings, env=env),
            ]
            beating: asyncio.Task[None] | None = None
            try:
                for proc in procs:
                    await proc.start()
                gateway = procs[-1]
                url = next(ln["url"] for ln in gateway.lines if ln["event"] == "gateway.listening")
                async with await Client.connect(settings) as lf:
                    beating = asyncio.create_task(beat(lf, settings, direct.removesuffix("/v1")))
                    tuned, served = await serve_one(lf, settings, direct)
                    times = await measure(direct, f"{url}/v1", key, tuned, served, n)
            finally:
                if beating is not None:
                    beating.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await beating
                for proc in reversed(procs):
                    await proc.stop()
                engine.terminate()
                await engine.wait()
    report(times)


def report(times: dict[str, list[float]]) -> None:
    ms = 1000.0
    for way, samples in times.items():
        print(f"completion {way:10s} p50 {percentile(samples, 0.5) * ms:6.2f} ms  "
              f"p99 {percentile(samples, 0.99) * ms:6.2f} ms")  # fmt: skip
    for q in (0.5, 0.99):
        direct = percentile(times["direct"], q)
        engines = percentile(times["by engines"], q) - direct
        records = percentile(times["by records"], q) - direct
        ratio = records / engines if engines > 0 else float("nan")
        print(f"gateway overhead p{int(q * 100)}: by engines {engines * ms:.2f} ms, "
              f"by records {records * ms:.2f} ms ({ratio:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=300)
    asyncio.run(main(p.parse_args().requests))
