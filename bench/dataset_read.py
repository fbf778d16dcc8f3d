"""Reading a dataset as a node: lorafleet.objects.read_object against nats-py's
ObjectStore.get (the baseline), on the same object of a real nats-server.

    .venv/bin/python bench/dataset_read.py [--mib 32] [--runs 3]

read_object asks for the info with one STREAM.MSG.GET request and for the
chunks (128 KiB each here) 16 at a time with batched DIRECT.GET requests,
the next asked for while one is written, which a node's credentials allow;
nats-py's get streams
the chunks through a push consumer, which needs the stream-name lookup,
stream info and consumer create. Printed: the best seconds of each over
`runs`, MiB/s, and read_object's time as a ratio to nats-py's.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import tempfile
import time
from pathlib import Path

from lorafleet import objects
from lorafleet.nats import _bus as bus
from lorafleet.nats.server import NatsServer
from lorafleet.settings import Settings


async def main(mib: int, runs: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        async with NatsServer(Path(tmp) / "store") as server:
            settings = Settings(nats_url=server.url)
            nc = await bus.connect(settings, "bench")
            js = nc.jetstream()
            await bus.ensure_layout(js, bus.layout_for(settings))
            bucket = settings.names.datasets_bucket
            store = await js.object_store(bucket)
            data = os.urandom(mib << 20)
            await store.put("bench", data)
            best: dict[str, float] = {}
            for _ in range(runs):
                for label in ("nats-py get", "read_object"):
                    out = io.BytesIO()
                    t0 = time.perf_counter()
                    if label == "read_object":
                        await objects.read_object(js, bucket, "bench", out)
                    else:
                        await store.get("bench", writeinto=out)
                    seconds = time.perf_counter() - t0
                    assert out.getvalue() == data
                    best[label] = min(best.get(label, seconds), seconds)
            await bus.drain_quietly(nc)
    for label, seconds in best.items():
        print(f"{label:12s} {seconds:7.3f} s  {mib / seconds:8.1f} MiB/s")
    print(f"read_object / nats-py get: {best['read_object'] / best['nats-py get']:.2f}x the time")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=32)
    p.add_argument("--runs", type=int, default=3)
    a = p.parse_args()
    asyncio.run(main(a.mib, a.runs))
