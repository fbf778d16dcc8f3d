"""What TLS and nkey identities cost: submit-to-start and artifact delivery,
secured against plain connections, in the same script.

    .venv/bin/python bench/auth_cost.py [--jobs 100] [--mib 64] [--rounds 3]

Each mode runs its own nats-server (JetStream, file storage), a throwaway
PostgreSQL database (bench/scheduler_common's), and the recorder, scheduler
and artifact-store as real processes. One simulated node (scheduler_common's
Fleet) heartbeats and answers start requests from this process; the client
is this process too.

- plain (the baseline): no authentication, `nats://`, every process the same
  anonymous user;
- secured: `lorafleet auth`'s config (one nkey per process, each with its
  least-privilege block), a TLS-only server with a certificate made on the
  spot (openssl), every process checking it by the CA — the services, the
  node and the client each on its own identity.

Measured per mode: submit-to-start (client submit request until the node
has the scheduler's start request; the job is then cancelled), `--jobs`
trials after a warm-up; and artifact delivery (the node's deliver() of a
`--mib` MiB adapter until the client hears the job `done`, i.e. the
artifact-store committed and the recorder recorded it), best of `--rounds`.
Plain and secured runs alternate `--repeat` times (a shared machine's load
drifts); prints each run and the ratios secured/plain of each pair.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from lorafleet.access.identities import IdentityStore, ensure_fleet
from lorafleet.access.identities import server_config as identities_config
from lorafleet.client import Client
from lorafleet.nats import _bus as bus
from lorafleet.nats.config import ServerTls
from lorafleet.nats.server import NatsServer
from lorafleet.settings import Settings
from lorafleet_schemas.messages import (
    ArtifactKind,
    Engine,
    JobSpec,
    JobState,
    ModelSpec,
    StartRequest,
    StatusReport,
)
from lorafleet_services.agent.transfer.delivery import deliver
from lorafleet_services.stack import ServiceProcess
from scheduler_common import Fleet, percentile, summary

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.*
from tests.eventually import eventually
from tests.permissions.certs import make_certs
from tests.pg import throwaway_database

NODE = "sim-0000"
DATA = "".join(json.dumps({"q": f"q{i}", "a": f"a{i}"}) + "\n" for i in range(10))
#: Trials run first and not counted (connections, caches, the database warm up).
WARMUP = 10
#: Seconds between two looks at what the callbacks have noted.
POLL_S = 0.001
#: Seconds one job may take to reach a state.
STATE_TIMEOUT_S = 60.0


@dataclass
class Mode:
    """The settings of each process in one mode (the same ones when plain)."""

    name: str
    service: dict[str, Settings]
    client: Settings
    node: Settings


@asynccontextmanager
async def secured_or_plain(root: Path, secured: bool, db_url: str) -> AsyncIterator[Mode]:
    base = Settings(data_dir=str(root / "data"), database_url=db_url)
    if not secured:
        server = await NatsServer(root / "nats").start()
        plain = base.with_(nats_url=server.url)
        nc = await bus.connect(plain, "bench-layout")
        await bus.ensure_layout(nc.jetstream(), bus.layout_for(plain))
        await bus.drain_quietly(nc)
        services = ("recorder", "artifact-store", "scheduler")
        yield Mode("plain", dict.fromkeys(services, plain), plain, plain)
        await server.stop()
        return
    store = IdentityStore(root / "identities")
    identities, _ = ensure_fleet(store, [NODE])
    certs = make_certs(root / "certs")
    conf = root / "nats.conf"
    tls = ServerTls(str(certs.server_cert), str(certs.server_key))
    conf.write_text(identities_config(base.names, identities, tls=tls))
    server = await NatsServer(root / "nats", config_file=conf).start()
    url = f"tls://{server.host}:{server.port}"

    def own(kind: str, name: str) -> Settings:
        ident = store.load(kind, name)
        return base.with_(
            nats_url=url,
            nats_nkey_seed=str(ident.seed_file),
            nats_inbox_prefix=ident.inbox_prefix,
            nats_tls_ca=str(certs.ca),
        )

    services = {s: own("service", s) for s in ("recorder", "artifact-store", "scheduler")}
    yield Mode("TLS + nkeys", services, own("client", "cli"), own("node", NODE))
    await server.stop()


async def submit_to_start(
    client: Client, fleet: Fleet, received: dict[str, float], jobs: int
) -> list[float]:
    latencies = []
    for i in range(WARMUP + jobs):
        t0 = time.perf_counter()
        job = await client.submit(JobSpec(model="tiny", gpu_memory_mib=1000, data=DATA, node=NODE))
        # The latency is stamped on arrival (on_start); polling only paces the loop.
        await eventually(
            lambda job_id=job.id: job_id in received, "the start request", interval_s=POLL_S
        )
        if i >= WARMUP:
            latencies.append(received[job.id] - t0)
        await client.cancel(job.id, "bench")
        await eventually(lambda: fleet.nodes[NODE].job is None, "the cancel", interval_s=POLL_S)
    return latencies


async def delivery(client: Client, fleet: Fleet, mode: Mode, starts: dict[str, StartRequest],
                   path: Path) -> float:  # fmt: skip
    """Seconds from deliver()'s start until the client hears the job `done`."""
    job = await client.submit(JobSpec(model="tiny", gpu_memory_mib=1000, data=DATA, node=NODE))
    await eventually(lambda: job.id in starts, "the start request", interval_s=POLL_S)
    req = starts[job.id]
    names = mode.node.names
    report = StatusReport(job_id=job.id, node=NODE, attempt=req.attempt, seq=1,
                          time=dt.datetime.now(dt.UTC), state=JobState.UPLOADING)  # fmt: skip
    await fleet.nc.jetstream().publish(names.status(NODE, job.id), bus.encode(report))
    await client.wait(job.id, frozenset({JobState.UPLOADING}), timeout_s=STATE_TIMEOUT_S)
    t0 = time.perf_counter()
    await deliver(fleet.nc.jetstream(), names, node=NODE, job_id=job.id, attempt=req.attempt,
                  kind=ArtifactKind.PEFT, path=path)  # fmt: skip
    done = await client.wait(job.id, timeout_s=STATE_TIMEOUT_S)
    seconds = time.perf_counter() - t0
    if done.state is not JobState.DONE:
        raise SystemExit(f"the delivery ended the job {done.state.value}: {done.message}")
    fleet.nodes[NODE].job = None
    await fleet.beat(fleet.nodes[NODE])
    return seconds


async def measure(secured: bool, jobs: int, path: Path, rounds: int) -> tuple[list[float], float]:
    with (
        tempfile.TemporaryDirectory(prefix="lorafleet-auth-") as tmp,
        throwaway_database("lorafleet_bench_auth") as db_url,
    ):
        async with AsyncExitStack() as stack:
            mode = await stack.enter_async_context(secured_or_plain(Path(tmp), secured, db_url))
            for module, name in (("recorder", "recorder"), ("artifact_store", "artifact-store"),
                                 ("scheduler", "scheduler")):  # fmt: skip
                proc = ServiceProcess(f"lorafleet_services.{module}", mode.service[name])
                await proc.start()
                stack.push_async_callback(proc.stop)
            client = Client(await bus.connect(mode.client, "bench-client"), mode.client)
            stack.push_async_callback(client.close)
            await client.add_model(ModelSpec(name="tiny", engine=Engine.VLLM, local_dir="/m"))
            received: dict[str, float] = {}
            starts: dict[str, StartRequest] = {}

            def on_start(_node: str, req: StartRequest, at: float) -> None:
                received[req.job_id] = at
                starts[req.job_id] = req

            node_nc = await bus.connect(mode.node, "bench-node")
            stack.push_async_callback(bus.drain_quietly, node_nc)
            fleet = Fleet(node_nc, mode.node, 1, on_start=on_start)
            await fleet.start()  # its one node is named sim-0000, NODE
            stack.push_async_callback(fleet.stop)
            await eventually(
                client.nodes, "the node to be listed", until=lambda r: any(n.alive for n in r.nodes)
            )
            latencies = await submit_to_start(client, fleet, received, jobs)
            best = min([await delivery(client, fleet, mode, starts, path) for _ in range(rounds)])
            print(f"{mode.name:>12}: submit-to-start {summary(latencies)}; "
                  f"delivery {path.stat().st_size / best / 1e6:.1f} MB/s")  # fmt: skip
            return latencies, best


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=100)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=2, help="plain/secured pairs, alternated")
    args = ap.parse_args()
    p99_ratios, median_ratios, throughput_ratios = [], [], []
    with tempfile.TemporaryDirectory(prefix="lorafleet-auth-data-") as tmp:
        path = Path(tmp) / "adapter.bin"
        path.write_bytes(os.urandom(args.mib << 20))
        # Pairs alternate, so that a busier moment of a shared machine hits both modes.
        for _ in range(args.repeat):
            plain_lat, plain_s = await measure(False, args.jobs, path, args.rounds)
            sec_lat, sec_s = await measure(True, args.jobs, path, args.rounds)
            p99_ratios.append(percentile(sec_lat, 99) / percentile(plain_lat, 99))
            median_ratios.append(statistics.median(sec_lat) / statistics.median(plain_lat))
            throughput_ratios.append(plain_s / sec_s)

    def listed(ratios: list[float]) -> str:
        return ", ".join(f"{r:.2f}" for r in ratios) + f" (median {statistics.median(ratios):.2f})"

    print(f"TLS + nkeys / plain, per pair: submit-to-start p99 {listed(p99_ratios)}")
    print(f"                               submit-to-start median {listed(median_ratios)}")
    print(f"                               delivery throughput {listed(throughput_ratios)}")
    print(f"CPU cores: {os.cpu_count()}, load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    asyncio.run(main())
