"""A rolling restart of the three NATS members, as an agent's heartbeat feels it.

The agent fences itself when no heartbeat is acknowledged for 2.5 s (the
bound of the default 3 s node timeout), so what a rolling restart costs it
is the longest gap between two acknowledged writes to the heartbeat bucket.
This bench writes to an R3 KV bucket every 20 ms (each put bounded at 1 s)
from one client connected to every member, while each member in turn is
stopped, started and waited for, and prints, per way of stopping, the
longest gap between acknowledged puts and the puts that failed:

  terminate   SIGTERM (what `docker compose restart` sends by default): the
              server steps down its leaderships and closes its clients at once
  lame duck   SIGUSR2 (compose's stop_signal for the members): leaderships
              moved first, clients sent away after the grace period (2 s),
              one a second at most

Each way gets a fresh cluster per round; rounds alternate the ways.

    .venv/bin/python bench/nats_rolling_restart.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

import nats
from nats.js.api import KeyValueConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lorafleet.nats.cluster import NatsCluster

#: Seconds between two puts, and the most one put may take.
PUT_EVERY_S = 0.02
PUT_TIMEOUT_S = 1.0
#: Seconds every member runs between two restarts.
SETTLE_S = 2.0


async def roll(lame_duck: bool, root: Path) -> tuple[float, int, int]:
    """One rolling restart: (longest gap between acknowledged puts, failed, puts)."""
    cluster = await NatsCluster(root).start()
    nc = await nats.connect(
        servers=cluster.urls(), max_reconnect_attempts=-1, reconnect_time_wait=0.1
    )
    try:
        kv = await nc.jetstream().create_key_value(
            KeyValueConfig(bucket="beats", replicas=3, history=1)
        )
        acked = [time.monotonic()]
        failed = 0
        stop = asyncio.Event()

        async def beat() -> None:
            nonlocal failed
            for n in range(1_000_000):
                if stop.is_set():
                    return
                try:
                    await asyncio.wait_for(kv.put("node-1", str(n).encode()), PUT_TIMEOUT_S)
                    acked.append(time.monotonic())
                except Exception:
                    failed += 1
                await asyncio.sleep(PUT_EVERY_S)

        beating = asyncio.create_task(beat())
        await asyncio.sleep(SETTLE_S)
        for member in cluster.names:
            await cluster.restart(member, kill=False, lame_duck=lame_duck)
            await asyncio.sleep(SETTLE_S)
        stop.set()
        await beating
        gaps = [b - a for a, b in itertools.pairwise(acked)]
        return max(gaps), failed, len(acked) - 1 + failed
    finally:
        await nc.close()
        await cluster.stop()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    results: dict[bool, list[tuple[float, int, int]]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(prefix="lorafleet-roll-") as tmp:
        for r in range(args.rounds):
            for lame_duck in (False, True):
                got = await roll(lame_duck, Path(tmp) / f"{r}-{int(lame_duck)}")
                results[lame_duck].append(got)
                name = "lame duck" if lame_duck else "terminate"
                print(f"round {r + 1} {name:9}: longest gap {got[0]:.3f} s, "
                      f"{got[1]} of {got[2]} puts failed", flush=True)  # fmt: skip
    for lame_duck in (False, True):
        name = "lame duck" if lame_duck else "terminate"
        gaps = [g for g, _, _ in results[lame_duck]]
        print(f"{name:9}: longest gap median {statistics.median(gaps):.3f} s, "
              f"worst {max(gaps):.3f} s; failed puts "
              f"{sum(f for _, f, _ in results[lame_duck])}")  # fmt: skip
    term = statistics.median(g for g, _, _ in results[False])
    ldm = statistics.median(g for g, _, _ in results[True])
    print(f"lame duck / terminate (median longest gap): {ldm / term:.2f}x")


if __name__ == "__main__":
    asyncio.run(main())
