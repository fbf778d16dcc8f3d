"""The slow-disk fault (tests/slow_fs.py, tests/disks.py): a nats-server whose
store is on the slow filesystem works through it, and while it stalls each
JetStream write waits for the disk; cleared, it goes on. The nemesis puts
one member's store there (bench/nemesis_stack.py) and stalls it (disk.slow)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from lorafleet.nats import _bus as bus
from lorafleet.nats.server import NatsServer
from lorafleet.settings import Settings
from tests import disks

#: Seconds each write and fsync waits while stalled.
STALL_S = 0.4


@pytest.mark.skipif(disks.slow_unavailable() is not None, reason=str(disks.slow_unavailable()))
async def test_a_server_on_a_stalled_disk_waits_for_it_and_goes_on(tmp_path: Path) -> None:
    store = tmp_path / "store"
    with disks.slow_filesystem(store) as disk:
        async with NatsServer(store) as server:
            nc = await bus.connect(Settings(nats_url=server.url), "slow-disk")
            try:
                js = nc.jetstream()
                kv = await js.create_key_value(bucket="slow")
                await kv.put("k", b"before")
                disk.stall(STALL_S)
                await asyncio.sleep(0.2)  # past the filesystem's look at its control file
                started = time.monotonic()
                await kv.put("k", b"stalled")
                stalled_s = time.monotonic() - started
                disk.clear()
                await kv.put("k", b"after")
                assert (await kv.get("k")).value == b"after"
            finally:
                await nc.close()
        # What the server wrote went through to the disk under the mount.
        backing = store.with_name(store.name + ".backing")
        assert any(p.is_file() and p.stat().st_size for p in backing.rglob("*.blk"))
    assert not store.is_mount()
    # The stalled put waited for the disk (its write, at least once).
    assert stalled_s >= STALL_S, stalled_s
