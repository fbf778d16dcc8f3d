"""The heartbeat: its record in KV, its expiry after a SIGKILL, its pace under load."""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
from pathlib import Path

import msgspec
from nats.js.kv import KeyValue

from lorafleet_schemas.messages import Heartbeat, JobState
from lorafleet_services.agent.node.cards import read_cards
from tests.agent.conftest import Bus, start_request


def _install_engines(root: Path) -> None:
    for v in ("0.9.2", "0.10.1"):
        py = root / "vllm" / v / "bin" / "python3"
        py.parent.mkdir(parents=True)
        py.write_text("")
        py.chmod(0o755)
    (root / "llamacpp" / "b6100-cuda12").mkdir(parents=True)


async def test_heartbeat_record_and_expiry_after_sigkill(fleet: Bus) -> None:
    fleet.settings = fleet.settings.with_(heartbeat_s=0.5, node_timeout_s=2)
    _install_engines(fleet.tmp_path / "engines")
    stale = fleet.tmp_path / "agent-node-1" / "jobs" / "job-from-before"
    stale.mkdir(parents=True)
    kv = await fleet.js.key_value(fleet.settings.names.nodes_bucket)
    watcher = await kv.watch("node-1")
    loop = asyncio.get_running_loop()

    agent = await fleet.agent()
    assert not stale.exists(), "a job directory from an earlier run survived the restart"

    beat_times: list[float] = []
    record: Heartbeat | None = None
    while len(beat_times) < 3:
        entry = await watcher.updates(timeout=5)
        if entry is None or entry.operation is not None:
            continue
        beat_times.append(loop.time())
        record = msgspec.json.decode(entry.value, type=Heartbeat, strict=True)
    assert record is not None
    assert record.node == "node-1"
    assert record.job is None
    cards = read_cards()  # [] where there is no NVIDIA driver
    assert [(c.index, c.name, c.total_mib) for c in record.cards] == [
        (c.index, c.name, c.total_mib) for c in cards
    ]
    assert record.cpu_training is (not cards)
    assert record.heartbeat_s == 0.5 and record.ttl_s == 2
    assert record.engines.vllm == ["0.9.2", "0.10.1"]
    assert record.engines.llamacpp == "b6100"
    assert record.version
    assert record.started_at <= record.time
    said = len(agent.events("node.no_cards"))
    assert said == (0 if cards else 1), "say 'no cards' once, not every beat"

    agent.kill()
    killed_at = loop.time()
    while True:
        entry = await watcher.updates(timeout=10)
        if entry is not None and entry.operation == "PURGE":
            gone_after_s = loop.time() - killed_at
            break
    # The marker comes one TTL after the last beat, which was at most one
    # period before the kill.
    assert 2 - 0.5 - 0.3 <= gone_after_s <= 2 + 1.5, gone_after_s
    await watcher.stop()


def stored_at(entry: KeyValue.Entry) -> float:
    """When the server stored the entry (nats-py gives the message's
    metadata timestamp, a datetime, though it declares an int)."""
    created: object = entry.created
    assert isinstance(created, dt.datetime), created
    return created.timestamp()


async def test_heartbeat_keeps_its_pace_while_the_trainer_floods_lines(fleet: Bus) -> None:
    # The stand-in with no pause between steps prints lines as fast as it
    # can; every one becomes a JetStream publish on the agent's connection.
    await fleet.agent(
        env={"LORAFLEET_STANDIN_STEPS": "12000", "LORAFLEET_STANDIN_STEP_S": "0"},
    )
    name, sha = await fleet.upload()
    reports = await fleet.reports("node-1", "flood")
    kv = await fleet.js.key_value(fleet.settings.names.nodes_bucket)
    watcher = await kv.watch("node-1")

    taken = await fleet.start(start_request("flood", name, sha))
    assert taken.accepted
    await reports.until_state(JobState.RUNNING)
    beats: list[tuple[float, str | None]] = []
    counted: list[Heartbeat] = []

    async def watch() -> None:
        while True:
            entry = await watcher.updates(timeout=10)
            if entry is not None and entry.operation is None:
                hb = msgspec.json.decode(entry.value, type=Heartbeat)
                beats.append((stored_at(entry), hb.job))
                counted.append(hb)

    watching = asyncio.create_task(watch())
    await reports.until_state(JobState.UPLOADING, JobState.FAILED, timeout_s=90)
    watching.cancel()
    await watcher.stop()
    assert reports.states()[-1] == JobState.UPLOADING
    steps = [r.step for r in reports.items if r.loss is not None]
    assert steps[-1] == 12000 and len(steps) == 12000
    during = [t for t, job in beats if job == "flood"]
    assert during, f"no beat while training: {beats}"
    # One beat a second, from the moment it ran to the moment it uploaded
    # (however long the flood lasted on this machine); a beat held up by
    # the flood would show as a gap near the node timeout (3 s), and the
    # scheduler would fail the job. Each time on the host's clock where it
    # was made: a beat's when the server stored it (its TTL runs from
    # there), the two states' when the agent reported them. Not when this
    # test read them: it reads the 12,000 reports too, and on a loaded
    # machine falls behind by more than a beat (a CI run: a 2.2 s "gap").
    running_at, uploading_at = (
        next(r.time.timestamp() for r in reports.items if r.state == state)
        for state in (JobState.RUNNING, JobState.UPLOADING)
    )
    gaps = [b - a for a, b in itertools.pairwise([running_at, *during, uploading_at])]
    assert max(gaps) < 1.8, (gaps, beats)
    # The reply's beat count orders the take among the beats on no clock:
    # the beats numbered above it name the job until it ends there (the last
    # ones read may come after its end), never again after.
    assert taken.accepted_beat is not None and taken.agent_started_at is not None
    numbers = [hb.beat for hb in counted]
    assert numbers == sorted(set(numbers)) and numbers[-1] > taken.accepted_beat, numbers
    assert {hb.started_at for hb in counted} == {taken.agent_started_at}
    after = [hb.job for hb in counted if hb.beat > taken.accepted_beat]
    named = after.index(None) if None in after else len(after)
    assert named >= 1 and set(after[:named]) == {"flood"} and set(after[named:]) <= {None}, after
