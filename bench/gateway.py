"""The HTTP gateway's cost: a completion through it against the engine asked
directly, and a file upload through it against a direct object-store put.

    .venv/bin/python bench/gateway.py [--requests 300] [--mib 16] [--runs 4]

On one machine: a nats-server, the gateway as a process (as `lorafleet up`
runs it) and the small engine process of tests/gateway/engine.py (vLLM's
interface; it answers at once, so what is measured is the relay). Each
pair is taken in ABBA order (direct first, then the gateway first, ...).
Printed, from the same run, with the load average:

- completions (non-streaming, one keep-alive connection each way): p50
  and p99 of each, and the gateway's overhead at both (target: under 2 ms
  at p50);
- streaming: the time to the first server-sent event, direct and through
  the gateway, medians (target: no later than direct + 5 ms);
- upload: `--mib` MiB of q/a records as multipart `POST /v1/files`
  (checked with the records' rules while put, its file object stored)
  against `Client.upload_dataset` of the same size, medians of `--runs`
  (target: at least 0.8x).

Measured (bench/README.md has the latest), on the
shared 2-core machine, the code before the staged upload and after, ABBA:
upload 0.36x / 0.39x / 0.36x / 0.22x before (load 7.1, 6.1, 5.3, 4.6),
0.69x / 0.48x / 0.72x / 0.73x after (load 6.5, 5.9, 4.7, 4.4); at load
2.5 to 4.2, 0.37x / 0.18x / 0.51x / 0.30x before, 0.51x / 0.62x / 0.36x /
0.77x after (medians: 0.36x before, 0.66x after). The check now runs in
two worker processes beside a windowed put, and its q/a records take the
rule's short path. First event +2.0 to +5.7 ms after, +2.0 to +5.1 ms
before (load 2.5 to 7; +2.35 ms at load 0.7): the second HTTP hop, not
the relay (profiled: the gateway's own steps take 0.2 ms).
Quiet (load 0.3 to 1.1, all merged, three runs): p50 overhead 0.93 to
1.05 ms, first event +1.78 to +2.32 ms, upload 0.74x to 0.78x.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TypeVar

import httpx2

from lorafleet.client import Client
from lorafleet.nats.server import NatsServer
from lorafleet.settings import Settings
from lorafleet_services.gateway.api_keys import make_key
from lorafleet_services.gateway.config import API_KEYS_FILE_NAME
from lorafleet_services.stack import ServiceProcess

T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[1]
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "what is 2+2?"}]}


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def completions(direct: str, via: str, key: str, n: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"direct": [], "gateway": []}
    auth = {"authorization": f"Bearer {key}"}
    async with httpx2.AsyncClient() as a, httpx2.AsyncClient(headers=auth) as b:
        for _ in range(20):  # warm both connections
            await a.post(f"{direct}/chat/completions", json=CHAT)
            await b.post(f"{via}/chat/completions", json=CHAT)
        pair = (("direct", a, direct), ("gateway", b, via))
        for i in range(n):
            for label, http, base in abba(pair, i):
                t0 = time.perf_counter()
                reply = await http.post(f"{base}/chat/completions", json=CHAT)
                times[label].append(time.perf_counter() - t0)
                assert reply.status_code == 200, reply.text
    return times


async def first_event(http: httpx2.AsyncClient, base: str) -> float:
    t0 = time.perf_counter()
    body = {**CHAT, "stream": True}
    first: float | None = None
    async with http.stream("POST", f"{base}/chat/completions", json=body) as reply:
        async for _ in reply.aiter_raw():
            if first is None:
                first = time.perf_counter() - t0
    assert first is not None
    return first


async def streaming(direct: str, via: str, key: str, n: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"direct": [], "gateway": []}
    auth = {"authorization": f"Bearer {key}"}
    async with httpx2.AsyncClient() as a, httpx2.AsyncClient(headers=auth) as b:
        for i in range(n):
            for label, http, base in abba((("direct", a, direct), ("gateway", b, via)), i):
                times[label].append(await first_event(http, base))
    return times


def records(mib: int, salt: str) -> bytes:
    line = json.dumps({"q": f"{salt} what is the capital of France?", "a": "Paris. " * 20})
    return ((line + "\n") * ((mib << 20) // (len(line) + 1))).encode()


def abba(pair: tuple[T, T], i: int) -> tuple[T, T]:
    """The two in turn A B, B A, A B, ... (what runs first is favoured on a
    shared machine as often as not)."""
    return pair if i % 2 == 0 else (pair[1], pair[0])


async def uploads(
    settings: Settings, via: str, key: str, mib: int, runs: int
) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"direct put": [], "gateway": []}
    async with await Client.connect(settings) as lf, httpx2.AsyncClient(timeout=300) as http:

        async def direct(data: bytes) -> None:
            await lf.upload_dataset(data)

        async def gateway(data: bytes) -> None:
            reply = await http.post(
                f"{via}/files", headers={"authorization": f"Bearer {key}"},
                data={"purpose": "fine-tune"}, files={"file": ("data.jsonl", data)},
            )  # fmt: skip
            assert reply.status_code == 200, reply.text

        for run in range(runs):
            for label, put in abba((("direct put", direct), ("gateway", gateway)), run):
                data = records(mib, f"{label}-{run}")
                t0 = time.perf_counter()
                await put(data)
                times[label].append(time.perf_counter() - t0)
    return times


async def start_engine() -> tuple[asyncio.subprocess.Process, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.gateway.engine", cwd=ROOT, stdout=asyncio.subprocess.PIPE
    )
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 20)
    return proc, line.decode().split()[-1] + "/v1"


async def main(n: int, mib: int, runs: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        async with NatsServer(Path(tmp) / "store") as server:
            settings = Settings(nats_url=server.url, data_dir=tmp)
            key = make_key(Path(tmp) / API_KEYS_FILE_NAME, "bench")
            engine, direct = await start_engine()
            env = {"LORAFLEET_GATEWAY_ADDR": "127.0.0.1:0", "LORAFLEET_GATEWAY_ENGINES": direct}
            gateway = ServiceProcess("lorafleet_services.gateway", settings, env=env)
            try:
                await gateway.start()
                url = next(ln["url"] for ln in gateway.lines if ln["event"] == "gateway.listening")
                via = f"{url}/v1"
                plain = await completions(direct, via, key, n)
                streamed = await streaming(direct, via, key, max(20, n // 5))
                uploaded = await uploads(settings, via, key, mib, runs)
            finally:
                await gateway.stop()
                engine.terminate()
                await engine.wait()
    report(plain, streamed, uploaded, mib)


def report(
    plain: dict[str, list[float]],
    streamed: dict[str, list[float]],
    uploaded: dict[str, list[float]],
    mib: int,
) -> None:
    ms = 1000.0
    for label, samples in plain.items():
        print(f"completion {label:8s} p50 {percentile(samples, 0.5) * ms:6.2f} ms  "
              f"p99 {percentile(samples, 0.99) * ms:6.2f} ms")  # fmt: skip
    for q in (0.5, 0.99):
        extra = percentile(plain["gateway"], q) - percentile(plain["direct"], q)
        print(f"gateway overhead p{int(q * 100)}: {extra * ms:.2f} ms")
    first = {k: statistics.median(v) for k, v in streamed.items()}
    later = first["gateway"] - first["direct"]
    print(f"first event (median) direct {first['direct'] * ms:.2f} ms, gateway "
          f"{first['gateway'] * ms:.2f} ms (+{later * ms:.2f} ms)")  # fmt: skip
    up = {label: statistics.median(samples) for label, samples in uploaded.items()}
    for label, seconds in up.items():
        each = " ".join(f"{s:.3f}" for s in uploaded[label])
        print(
            f"upload {label:10s} {seconds:6.3f} s  {mib / seconds:7.1f} MiB/s  (median of {each})"
        )
    print(f"upload gateway / direct: {up['direct put'] / up['gateway']:.2f}x the throughput")
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--mib", type=int, default=16)
    p.add_argument("--runs", type=int, default=4)
    args = p.parse_args()
    asyncio.run(main(args.requests, args.mib, args.runs))
