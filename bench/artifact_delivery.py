"""Benchmark: delivering a 200 MiB artifact through the agent's deliver() and the
artifact-store, against a raw JetStream publish of the same bytes.

    .venv/bin/python bench/artifact_delivery.py [--mib 200] [--rounds 3]

One nats-server (JetStream, file storage, its own temporary store), the
recorder and the artifact-store as real processes, as in production.

- baseline: the same bytes in the same chunks (512 KiB) published to a plain
  file-storage stream with the same window of unacknowledged publishes,
  timed until every publish is acknowledged;
- lorafleet: deliver() from the start until the artifact-store has committed
  the object (its info readable; count, size and sha256 checked on commit);
  the object is downloaded afterwards (untimed) and its bytes compared.

Prints both throughputs (MB/s, 10^6 bytes) and the ratio lorafleet/baseline
(target >= 0.8), best of `--rounds` each.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nats
import psutil
from nats.aio.client import Client
from nats.js.api import StorageType, StreamConfig

from lorafleet.artifacts import (
    AsyncPublisher,
    download_artifact,
    get_record,
)
from lorafleet.names import Names, artifact_object_name, object_meta_subject
from lorafleet.nats._bus import ensure_layout, layout_for
from lorafleet.nats.server import NatsServer
from lorafleet.settings import Settings
from lorafleet_schemas.messages import ArtifactKind
from lorafleet_services.agent.transfer.delivery import DEFAULT_CHUNK_BYTES, WINDOW_CHUNKS, deliver

N = Names()
QA = '{"q": "2+2?", "a": "4"}\n'


async def start_service(module: str, settings: Settings) -> asyncio.subprocess.Process:
    env = {**os.environ, **settings.to_env(), "PYTHONUNBUFFERED": "1"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", module, env=env, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    assert proc.stderr is not None
    while line := await asyncio.wait_for(proc.stderr.readline(), 60):
        if b'"service.started"' in line:
            asyncio.get_running_loop().create_task(_drain(proc))
            return proc
    raise RuntimeError(f"{module} did not start")


async def _drain(proc: asyncio.subprocess.Process) -> None:
    assert proc.stderr is not None
    while await proc.stderr.readline():
        pass


async def api(nc: Client, subject: str, body: dict[str, object]) -> dict[str, object]:
    msg = await nc.request(subject, json.dumps(body).encode(), timeout=10)
    out: dict[str, object] = json.loads(msg.data)
    if "error" in out:
        raise RuntimeError(f"{subject}: {out}")
    return out


async def new_job(nc: Client) -> tuple[str, int]:
    job = await api(nc, N.jobs_submit, {"model": "bench", "gpu_memory_mib": 1, "data": QA})
    job_id = str(job["id"])
    for frm, to, extra in (("queued", "starting", {"node": "n1"}), ("starting", "uploading", {})):
        await api(
            nc, N.store_transition, {"id": job_id, "from_state": frm, "to_state": to, **extra}
        )
    return job_id, 1


async def raw_publish(nc: Client, path: Path, round_: int) -> float:
    """The baseline: the same chunks, the same window, to a plain stream."""
    js = nc.jetstream()
    subject = f"bench.raw.{round_}"
    start = time.perf_counter()
    async with AsyncPublisher(nc) as pub:
        window: list[asyncio.Future[int]] = []
        with path.open("rb") as f:
            while body := f.read(DEFAULT_CHUNK_BYTES):
                window.append(await pub.publish(subject, body))
                if len(window) >= WINDOW_CHUNKS:
                    await window.pop(0)
        for fut in window:
            await fut
    seconds = time.perf_counter() - start
    await js.purge_stream("BENCH_RAW")
    return seconds


async def lorafleet_delivery(nc: Client, path: Path) -> tuple[float, float, str]:
    js = nc.jetstream()
    job_id, attempt = await new_job(nc)
    # The commit is the object's info message: a plain subscriber sees it as it is stored.
    committed = await nc.subscribe(
        object_meta_subject(N.artifacts_bucket, artifact_object_name(job_id, "peft")), max_msgs=1
    )
    start = time.perf_counter()
    await deliver(js, N, node="n1", job_id=job_id, attempt=attempt, kind=ArtifactKind.PEFT,
                  path=path)  # fmt: skip
    delivered_s = time.perf_counter() - start
    await committed.next_msg(timeout=120)
    seconds = time.perf_counter() - start
    # A plain subscriber can see the info message a moment before the stream
    # has stored it (seen once in 40 rounds): give the read a few seconds.
    for _ in range(50):
        if await get_record(js, N, job_id, "peft") is not None:
            break
        await asyncio.sleep(0.1)
    else:
        raise SystemExit("the artifact-store committed nothing readable")
    return seconds, delivered_s, job_id


def cpu_s(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds (user + system) each process has used so far."""
    out = {}
    for name, pid in pids.items():
        t = psutil.Process(pid).cpu_times()
        out[name] = t.user + t.system
    return out


def cpu_used(before: dict[str, float], after: dict[str, float]) -> str:
    return ", ".join(f"{k} {after[k] - before[k]:.2f}" for k in before)


async def main(mib: int, rounds: int) -> None:
    with tempfile.TemporaryDirectory(prefix="lorafleet-bench-") as tmp:
        root = Path(tmp)
        server = await NatsServer(root / "nats").start()
        settings = Settings(
            nats_url=server.url, data_dir=str(root / "data"),
            database_url=f"sqlite+aiosqlite:///{root / 'bench.db'}",
        )  # fmt: skip
        procs = []
        nc = await nats.connect(server.url)
        try:
            js = nc.jetstream()
            await ensure_layout(js, layout_for(settings))
            await js.add_stream(
                StreamConfig(name="BENCH_RAW", subjects=["bench.raw.>"], storage=StorageType.FILE)
            )
            procs.append(await start_service("lorafleet_services.recorder", settings))
            procs.append(await start_service("lorafleet_services.artifact_store", settings))
            await api(nc, N.models_add, {"name": "bench", "engine": "vllm", "hf_repo": "o/b"})
            path = root / "artifact.bin"
            with path.open("wb") as f:
                for _ in range(mib):
                    f.write(os.urandom(1 << 20))
            size = path.stat().st_size
            sha = hashlib.sha256(path.read_bytes()).hexdigest()
            raw_s: list[float] = []
            lf_s: list[float] = []
            dl_s: list[float] = []
            assert server.proc is not None
            pids = {"nats-server": server.proc.pid, "agent (this)": os.getpid(),
                    "artifact-store": procs[1].pid}  # fmt: skip
            for r in range(rounds):
                c0 = cpu_s(pids)
                raw_s.append(await raw_publish(nc, path, r))
                c1 = cpu_s(pids)
                seconds, delivered_s, job_id = await lorafleet_delivery(nc, path)
                lf_s.append(seconds)
                dl_s.append(delivered_s)
                c2 = cpu_s(pids)
                print(f"  CPU s, raw: {cpu_used(c0, c1)}; lorafleet: {cpu_used(c1, c2)}")
                out = root / "downloaded.bin"
                rec = await download_artifact(js, N, job_id, ArtifactKind.PEFT, out)
                if rec.sha256 != sha or out.read_bytes() != path.read_bytes():
                    raise SystemExit("the stored artifact differs from the delivered file")
                out.unlink()
                await js.purge_stream(f"OBJ_{N.artifacts_bucket}")
                print(
                    f"round {r + 1}: raw {size / raw_s[-1] / 1e6:7.1f} MB/s   "
                    f"lorafleet {size / lf_s[-1] / 1e6:7.1f} MB/s   "
                    f"(deliver() returned at {size / dl_s[-1] / 1e6:.1f} MB/s)"
                )
            raw_best, lf_best = min(raw_s), min(lf_s)
            print(f"artifact: {size / (1 << 20):.0f} MiB in {DEFAULT_CHUNK_BYTES >> 10} KiB chunks")
            print(
                f"raw JetStream publish (window {WINDOW_CHUNKS}): {size / raw_best / 1e6:7.1f} MB/s"
            )
            print(f"deliver() + artifact-store commit:        {size / lf_best / 1e6:7.1f} MB/s")
            print(f"ratio lorafleet/raw: {raw_best / lf_best:.2f} (target >= 0.8)")
            print(f"CPU cores: {os.cpu_count()}, load average {os.getloadavg()[0]:.1f}")
        finally:
            await nc.close()
            for p in procs:
                p.terminate()
                await p.wait()
            await server.stop()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    asyncio.run(main(a.mib, a.rounds))
