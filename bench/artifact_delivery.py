"""Benchmark: delivering a 200 MiB artifact through the agent's deliver() and the
artifact-store, and fetching it onto N nodes at once, against raw JetStream
publishes and reads of the same bytes.

    .venv/bin/python bench/artifact_delivery.py [--mib 200] [--rounds 3] [--nodes 3]
        [--chunk-kib 512]

One nats-server (JetStream, file storage, its own temporary store), the
recorder and the artifact-store as real processes, as in production.

- baseline: the same bytes in the same chunks (512 KiB, `--chunk-kib`) published to a plain
  file-storage stream with the same window of unacknowledged publishes,
  timed until every publish is acknowledged;
- lorafleet: deliver() from the start until the artifact-store has committed
  the object (its info readable; count, size and sha256 checked on commit);
  the object is downloaded afterwards (untimed) and its bytes compared;
- fetch, N nodes at once (`--nodes`, default 3; each a process of its own,
  started and connected before the rounds): baseline, each reads the raw
  round's chunks from the plain stream through an ordered consumer (what
  nats-py's object get uses) into memory; lorafleet, each runs the agent's
  `fetch_object` (what a node does to serve an adapter) into a file, and its
  sha256 is checked. Timed from the go to the last node's done;
- bytes once (a prototype of issue 29's proposal, not a product path): the
  same deliver() publishing straight into the object store's stream under a
  chunk subject no info message names, and a verifier process (the store's
  part) reading that subject as it fills, checking each chunk's place, the
  count and the sha256, and committing the info message; timed until the
  commit. Once more with the verifier told only when deliver() has returned
  ("read after"). What it leaves out: artifact_store/DESIGN.md, "Throughput".

Prints each throughput (MB/s, 10^6 bytes; a fetch's is all nodes' bytes
together) and the ratios lorafleet/baseline (issue 29's target: >= 0.5),
best of `--rounds` each; then the CPU seconds of all processes together
per delivery (least of the rounds), which hold still where the host's load
moves the wall clock (on two cores the two ratios agree).

Measured on the 2-core development host, shared with other work, 200 MiB
in 512 KiB chunks; ratios against raw (best of the rounds), then CPU s of
raw / delivery / bytes once (least of the rounds); more in
artifact_store/DESIGN.md, "Throughput":

    rounds (load)  delivery  bytes once (read after)  fetch by 3  CPU s
    3 (6-7)        0.32      0.42                     0.57        0.39 / 1.42 / 1.04
    5 (6-9)        0.28      0.48                     0.42        0.33 / 1.36 / 0.93
    4 (8-15)       0.38      0.65 (0.47)              0.36        0.46 / 1.61 / 1.16
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import nats
import psutil
from nats.aio.client import Client
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StorageType, StreamConfig

from lorafleet.artifacts import (
    AsyncPublisher,
    download_artifact,
    get_record,
    object_digest,
)
from lorafleet.names import (
    ROLLUP_SUBJECT,
    Header,
    Names,
    artifact_object_name,
    object_chunk_subject,
    object_meta_subject,
    object_stream,
)
from lorafleet.nats._bus import ensure_layout, layout_for
from lorafleet.nats._natspy import use_read_buffer
from lorafleet.nats.server import NatsServer
from lorafleet.settings import Settings
from lorafleet_schemas.messages import ArtifactChunkHeader, ArtifactKind
from lorafleet_services.agent.transfer.delivery import DEFAULT_CHUNK_BYTES, WINDOW_CHUNKS, deliver
from lorafleet_services.agent.transfer.fetch import fetch_object
from lorafleet_services.artifact_store.service import READ_BUFFER_BYTES

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


async def raw_publish(nc: Client, path: Path, round_: int, chunk_bytes: int) -> float:
    """The baseline: the same chunks, the same window, to a plain stream."""
    subject = f"bench.raw.{round_}"
    start = time.perf_counter()
    async with AsyncPublisher(nc) as pub:
        window: list[asyncio.Future[int]] = []
        with path.open("rb") as f:
            while body := f.read(chunk_bytes):
                window.append(await pub.publish(subject, body))
                if len(window) >= WINDOW_CHUNKS:
                    await window.pop(0)
        for fut in window:
            await fut
    return time.perf_counter() - start


async def lorafleet_delivery(nc: Client, path: Path, chunk_bytes: int) -> tuple[float, float, str]:
    js = nc.jetstream()
    job_id, attempt = await new_job(nc)
    # The commit is the object's info message: a plain subscriber sees it as it is stored.
    committed = await nc.subscribe(
        object_meta_subject(N.artifacts_bucket, artifact_object_name(job_id, "peft")), max_msgs=1
    )
    start = time.perf_counter()
    await deliver(js, N, node="n1", job_id=job_id, attempt=attempt, kind=ArtifactKind.PEFT,
                  path=path, chunk_bytes=chunk_bytes)  # fmt: skip
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


# --- bytes once: a prototype of issue 29's proposed delivery ---------------------
#
# The agent's deliver() publishes its chunks straight into the object store's
# stream, under a chunk subject no info message names; a verifier process
# (what the artifact-store would do) reads that subject as it fills, checks
# each chunk's place, the count and the sha256, and commits the info message
# naming those chunks. No state machine, no restart or replica handling: the
# ceiling of that design on this host, not a product path.

VERIFY_SUBJECT, VERIFIED_SUBJECT = "bench.verify.go", "bench.verify.done"
#: Messages the verifier asks for at once (as the store's read-back).
VERIFY_BATCH = 64


@dataclass(frozen=True, slots=True)
class StagedNames(Names):
    """Names whose artifact chunk subject is an object chunk subject (the staging)."""

    staging: str = ""

    @property
    def artifacts_stream(self) -> str:
        return object_stream(self.artifacts_bucket)

    def artifact_chunks(self, node: str, job_id: str, kind: str) -> str:
        return self.staging


async def verifier(url: str) -> None:
    """The prototype's store: on each go ({"subject", "nuid", "name", "count",
    "sha256"}), a consumer on the staging subject, "ready", then every chunk
    read and checked, the info committed, "done" (or the error)."""
    use_read_buffer(READ_BUFFER_BYTES)
    nc = await nats.connect(url)
    js = nc.jetstream()
    sub = await nc.subscribe(VERIFY_SUBJECT)
    await nc.publish(VERIFIED_SUBJECT, b"ready")
    while (msg := await sub.next_msg(timeout=600)).data != b"stop":
        try:
            await verify_staged(nc, js, json.loads(msg.data))
            await nc.publish(VERIFIED_SUBJECT, b"done")
        except Exception as e:
            await nc.publish(VERIFIED_SUBJECT, repr(e).encode())
    await nc.close()


async def verify_staged(nc: Client, js: JetStreamContext, go: dict[str, Any]) -> None:
    bucket = N.artifacts_bucket
    reader = await js.pull_subscribe(
        go["subject"],
        stream=object_stream(bucket),
        config=ConsumerConfig(
            ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL, mem_storage=True
        ),
    )
    await nc.publish(VERIFIED_SUBJECT, b"ready")
    h, seen, size, largest = hashlib.sha256(), 0, 0, 0
    while seen < go["count"]:
        for m in await reader.fetch(VERIFY_BATCH, timeout=30):
            header = msgspec.json.decode((m.headers or {})[Header.CHUNK], type=ArtifactChunkHeader)
            if header.seq != seen:
                raise RuntimeError(f"chunk {header.seq} stored where chunk {seen} belongs")
            h.update(m.data)
            seen, size, largest = seen + 1, size + len(m.data), max(largest, len(m.data))
    await reader.unsubscribe()
    if h.hexdigest() != go["sha256"]:
        raise RuntimeError(f"sha256 {h.hexdigest()}, not {go['sha256']}")
    info = {
        "name": go["name"], "bucket": bucket, "nuid": go["nuid"], "size": size,
        "chunks": seen, "digest": object_digest(go["sha256"]),
        "options": {"max_chunk_size": largest},
    }  # fmt: skip
    await js.publish(
        object_meta_subject(bucket, go["name"]),
        json.dumps(info).encode(),
        headers={Header.ROLLUP: ROLLUP_SUBJECT},
    )


async def staged_delivery(
    nc: Client,
    verified: Subscription,
    path: Path,
    sha: str,
    count: int,
    round_: int,
    *,
    chunk_bytes: int,
    read_after: bool = False,
) -> float:
    """The prototype timed: deliver() into the object stream until the verifier
    committed. The verifier reads from the first chunk on, or (`read_after`)
    is told only once deliver() has returned, as a store that learns of a
    delivery from its last message would be."""
    nuid = f"bench-staged-{round_}-{'after' if read_after else 'along'}"
    names = StagedNames(staging=object_chunk_subject(N.artifacts_bucket, nuid))
    go = json.dumps({"subject": names.staging, "nuid": nuid, "name": f"bench/{nuid}",
                     "count": count, "sha256": sha}).encode()  # fmt: skip

    async def tell_verifier() -> None:
        await nc.publish(VERIFY_SUBJECT, go)
        if (answer := (await verified.next_msg(timeout=30)).data) != b"ready":
            raise SystemExit(f"the prototype's verifier: {answer.decode()}")

    if not read_after:
        await tell_verifier()
    start = time.perf_counter()
    await deliver(nc.jetstream(), names, node="n1", job_id=nuid.replace("-", ""), attempt=1,
                  kind=ArtifactKind.PEFT, path=path, chunk_bytes=chunk_bytes)  # fmt: skip
    if read_after:
        await tell_verifier()
    answer = (await verified.next_msg(timeout=120)).data
    if answer != b"done":
        raise SystemExit(f"the prototype's verifier: {answer.decode()}")
    return time.perf_counter() - start


async def start_verifier(nc: Client, url: str) -> tuple[asyncio.subprocess.Process, Subscription]:
    verified = await nc.subscribe(VERIFIED_SUBJECT)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--verifier", url, start_new_session=True
    )
    await verified.next_msg(timeout=120)
    return proc, verified


# --- fetch: N nodes at once, each a process ------------------------------------

GO_SUBJECT, DONE_SUBJECT = "bench.fetch.go", "bench.fetch.done"


async def worker(url: str, index: int) -> None:
    """One node: on each go ({"raw": subject} or {"object": name, "sha256": hex}),
    read it whole and answer done (or the error)."""
    nc = await nats.connect(url)
    js = nc.jetstream()
    sub = await nc.subscribe(GO_SUBJECT)
    await nc.publish(DONE_SUBJECT, b"ready")
    with tempfile.TemporaryDirectory(prefix="lorafleet-bench-node-") as tmp:
        while (msg := await sub.next_msg(timeout=600)).data != b"stop":
            go = json.loads(msg.data)
            try:
                if "raw" in go:
                    await raw_read(js, go["raw"], go["count"])
                else:
                    _size, sha = await fetch_object(js, N.artifacts_bucket, go["object"],
                                                   Path(tmp) / f"{index}.bin")  # fmt: skip
                    if sha != go["sha256"]:
                        raise RuntimeError(f"node {index} fetched sha256 {sha}")
                await nc.publish(DONE_SUBJECT, b"done")
            except Exception as e:
                await nc.publish(DONE_SUBJECT, repr(e).encode())
    await nc.close()


async def raw_read(js: JetStreamContext, subject: str, count: int) -> None:
    """The baseline read: every message of `subject`, through an ordered consumer."""
    sub = await js.subscribe(subject, ordered_consumer=True)
    for _ in range(count):
        await sub.next_msg(timeout=30)
    await sub.unsubscribe()


class Nodes:
    """N worker processes, told to go at once; `fetch` times one round."""

    def __init__(self, nc: Client, url: str, n: int) -> None:
        self.nc, self.url, self.n = nc, url, n
        self.procs: list[asyncio.subprocess.Process] = []

    async def start(self) -> None:
        self.done = await self.nc.subscribe(DONE_SUBJECT)
        for i in range(self.n):
            self.procs.append(await asyncio.create_subprocess_exec(
                sys.executable, __file__, "--worker", self.url, "--index", str(i),
                start_new_session=True,
            ))  # fmt: skip
        for _ in range(self.n):
            await self.done.next_msg(timeout=120)

    async def fetch(self, go: dict[str, object]) -> float:
        start = time.perf_counter()
        await self.nc.publish(GO_SUBJECT, json.dumps(go).encode())
        for _ in range(self.n):
            answer = (await self.done.next_msg(timeout=300)).data
            if answer != b"done":
                raise SystemExit(f"a node's fetch failed: {answer.decode()}")
        return time.perf_counter() - start

    async def stop(self) -> None:
        await self.nc.publish(GO_SUBJECT, b"stop")
        await self.nc.flush()
        for p in self.procs:
            try:
                await asyncio.wait_for(p.wait(), 10)
            except TimeoutError:
                p.kill()
                await p.wait()


def cpu_s(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds (user + system) each process has used so far."""
    out = {}
    for name, pid in pids.items():
        t = psutil.Process(pid).cpu_times()
        out[name] = t.user + t.system
    return out


def cpu_used(before: dict[str, float], after: dict[str, float]) -> str:
    return ", ".join(f"{k} {after[k] - before[k]:.2f}" for k in before)


def mbs(nbytes: float, seconds: float) -> str:
    return f"{nbytes / seconds / 1e6:7.1f} MB/s"


async def main(mib: int, rounds: int, nodes: int, chunk_bytes: int) -> None:
    with tempfile.TemporaryDirectory(prefix="lorafleet-bench-") as tmp:
        root = Path(tmp)
        server = await NatsServer(root / "nats").start()
        settings = Settings(
            nats_url=server.url, data_dir=str(root / "data"),
            database_url=f"sqlite+aiosqlite:///{root / 'bench.db'}",
        )  # fmt: skip
        procs = []
        nc = await nats.connect(server.url)
        fleet = Nodes(nc, server.url, nodes)
        try:
            js = nc.jetstream()
            await ensure_layout(js, layout_for(settings))
            await js.add_stream(
                StreamConfig(name="BENCH_RAW", subjects=["bench.raw.>"], storage=StorageType.FILE)
            )
            procs.append(await start_service("lorafleet_services.recorder", settings))
            procs.append(await start_service("lorafleet_services.artifact_store", settings))
            verifier_proc, verified = await start_verifier(nc, server.url)
            procs.append(verifier_proc)
            await fleet.start()
            await api(nc, N.models_add, {"name": "bench", "engine": "vllm", "hf_repo": "o/b"})
            path = root / "artifact.bin"
            with path.open("wb") as f:
                for _ in range(mib):
                    f.write(os.urandom(1 << 20))
            rounds_ = Rounds(nc, fleet, verified, path, chunk_bytes, {
                "nats-server": server.proc.pid if server.proc else 0,
                "agent (this)": os.getpid(), "artifact-store": procs[1].pid,
                "verifier": verifier_proc.pid,
            })  # fmt: skip
            for r in range(rounds):
                await rounds_.run(r)
            report(path.stat().st_size, nodes, chunk_bytes, rounds_.times, rounds_.cpu)
        finally:
            with contextlib.suppress(Exception):
                await fleet.stop()
            with contextlib.suppress(Exception):
                await nc.publish(VERIFY_SUBJECT, b"stop")
            await nc.close()
            for p in procs:
                with contextlib.suppress(ProcessLookupError):  # the verifier stops when told
                    p.terminate()
                await p.wait()
            await server.stop()


class Rounds:
    """Each round: raw publish, delivery, the bytes-once prototype, raw fetch by
    N, lorafleet fetch by N; the seconds of each, and the CPU seconds (all
    processes together) of the three deliveries."""

    def __init__(
        self,
        nc: Client,
        fleet: Nodes,
        verified: Subscription,
        path: Path,
        chunk_bytes: int,
        pids: dict[str, int],
    ) -> None:
        self.nc, self.fleet, self.verified, self.path, self.pids = nc, fleet, verified, path, pids
        self.size = path.stat().st_size
        self.sha = hashlib.sha256(path.read_bytes()).hexdigest()
        self.chunk_bytes = chunk_bytes
        self.count = -(-self.size // chunk_bytes)
        self.times: dict[str, list[float]] = {
            k: [] for k in ("raw", "lorafleet", "staged", "read after", "raw fetch", "fetch")
        }
        self.cpu: dict[str, list[float]] = {k: [] for k in ("raw", "lorafleet", "staged")}

    async def run(self, r: int) -> None:
        js, size, times = self.nc.jetstream(), self.size, self.times
        c0 = cpu_s(self.pids)
        times["raw"].append(await raw_publish(self.nc, self.path, r, self.chunk_bytes))
        c1 = cpu_s(self.pids)
        seconds, delivered_s, job_id = await lorafleet_delivery(
            self.nc, self.path, self.chunk_bytes
        )
        times["lorafleet"].append(seconds)
        c2 = cpu_s(self.pids)
        staged = await staged_delivery(
            self.nc, self.verified, self.path, self.sha, self.count, r,
            chunk_bytes=self.chunk_bytes,
        )  # fmt: skip
        times["staged"].append(staged)
        c3 = cpu_s(self.pids)
        times["read after"].append(await staged_delivery(
            self.nc, self.verified, self.path, self.sha, self.count, r,
            chunk_bytes=self.chunk_bytes, read_after=True,
        ))  # fmt: skip
        for k, (a, b) in {"raw": (c0, c1), "lorafleet": (c1, c2), "staged": (c2, c3)}.items():
            self.cpu[k].append(sum(b.values()) - sum(a.values()))
        print(f"  CPU s, raw: {cpu_used(c0, c1)}\n  lorafleet: {cpu_used(c1, c2)}\n"
              f"  bytes once: {cpu_used(c2, c3)}")  # fmt: skip
        out = self.path.with_name("downloaded.bin")
        rec = await download_artifact(js, N, job_id, ArtifactKind.PEFT, out)
        if rec.sha256 != self.sha or out.read_bytes() != self.path.read_bytes():
            raise SystemExit("the stored artifact differs from the delivered file")
        out.unlink()
        fleet = self.fleet
        times["raw fetch"].append(await fleet.fetch({"raw": f"bench.raw.{r}", "count": self.count}))
        obj = artifact_object_name(job_id, "peft")
        times["fetch"].append(await fleet.fetch({"object": obj, "sha256": self.sha}))
        await js.purge_stream("BENCH_RAW")
        await js.purge_stream(object_stream(N.artifacts_bucket))
        n = fleet.n
        print(
            f"round {r + 1}: raw {mbs(size, times['raw'][-1])}   "
            f"lorafleet {mbs(size, times['lorafleet'][-1])}   "
            f"(deliver() returned at {mbs(size, delivered_s).strip()})   "
            f"bytes once {mbs(size, staged)} (read after: "
            f"{mbs(size, times['read after'][-1]).strip()}); fetch by {n}: "
            f"raw {mbs(n * size, times['raw fetch'][-1])}   "
            f"lorafleet {mbs(n * size, times['fetch'][-1])}"
        )


def report(
    size: int,
    nodes: int,
    chunk_bytes: int,
    times: dict[str, list[float]],
    cpu: dict[str, list[float]],
) -> None:
    best = {k: min(v) for k, v in times.items()}
    least = {k: min(v) for k, v in cpu.items()}
    print(f"artifact: {size / (1 << 20):.0f} MiB in {chunk_bytes >> 10} KiB chunks")
    print(f"raw JetStream publish (window {WINDOW_CHUNKS}):  {mbs(size, best['raw'])}")
    print(f"deliver() + artifact-store commit:        {mbs(size, best['lorafleet'])}")
    print(f"bytes once (prototype, verified):         {mbs(size, best['staged'])}")
    print(f"raw fetch by {nodes} (ordered consumers):    {mbs(nodes * size, best['raw fetch'])}")
    print(f"fetch_object by {nodes} (to files, checked): {mbs(nodes * size, best['fetch'])}")
    print(f"ratio delivery lorafleet/raw: {best['raw'] / best['lorafleet']:.2f} (target >= 0.5)")
    print(f"ratio bytes once/raw:         {best['raw'] / best['staged']:.2f} "
          f"(read after the last chunk: {best['raw'] / best['read after']:.2f})")  # fmt: skip
    print(f"ratio fetch lorafleet/raw:    {best['raw fetch'] / best['fetch']:.2f} (target >= 0.5)")
    print(
        f"CPU s, all processes (least of the rounds): raw {least['raw']:.2f}, "
        f"lorafleet {least['lorafleet']:.2f}, bytes once {least['staged']:.2f}; "
        f"ratios raw/lorafleet {least['raw'] / least['lorafleet']:.2f}, "
        f"raw/bytes once {least['raw'] / least['staged']:.2f}"
    )
    print(f"CPU cores: {os.cpu_count()}, load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--nodes", type=int, default=3, help="nodes fetching at once")
    ap.add_argument(
        "--chunk-kib", type=int, default=DEFAULT_CHUNK_BYTES >> 10,
        help="KiB per chunk, raw and delivered alike (896 at most with the default "
        "1 MiB max payload: deliver() clamps)",
    )  # fmt: skip
    ap.add_argument("--worker", metavar="URL", help=argparse.SUPPRESS)
    ap.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--verifier", metavar="URL", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.verifier:
        asyncio.run(verifier(a.verifier))
    elif a.worker:
        asyncio.run(worker(a.worker, a.index))
    else:
        asyncio.run(main(a.mib, a.rounds, a.nodes, a.chunk_kib * 1024))
