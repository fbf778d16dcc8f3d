"""The node watcher fed KV entries by hand: no bus, a hand-driven clock."""

from __future__ import annotations

import itertools
from typing import Any

import msgspec
import structlog
from nats.js.api import (
    ClusterInfo,
    ConsumerConfig,
    ConsumerInfo,
    PeerInfo,
    SequenceInfo,
    StreamConfig,
    StreamInfo,
    StreamState,
)
from nats.js.kv import KeyValue
from structlog.testing import capture_logs

from lorafleet.log import Event
from lorafleet.names import KV_DEL, KV_PURGE
from lorafleet.nats._kv_watch import REBUILD_AFTER_S, KeyWatch, behind
from lorafleet_services.scheduler.node_table import SWEEP_MARGIN_S
from lorafleet_services.scheduler.nodes import Departure, NodeWatcher, departure
from tests.scheduler.clock import Clock
from tests.scheduler.test_logic import hb

TIMEOUT_S = 3.0
#: The bucket's stream sequence: each entry made here is the newest.
REVISIONS = itertools.count(1)


def entry(
    key: str, value: bytes = b"", operation: str | None = None, revision: int | None = None
) -> KeyValue.Entry:
    return KeyValue.Entry(
        bucket="lorafleet_nodes",
        key=key,
        value=value,
        revision=next(REVISIONS) if revision is None else revision,
        delta=0,
        created=None,
        operation=operation,
    )


def beat(node: str, job: str | None = None, revision: int | None = None) -> KeyValue.Entry:
    return entry(node, msgspec.json.encode(hb(node, job=job)), revision=revision)


def watcher(clock: Clock) -> tuple[NodeWatcher, list[int]]:
    wakes: list[int] = []
    w = NodeWatcher(TIMEOUT_S, clock, structlog.get_logger(), lambda: wakes.append(1))
    return w, wakes


def events(logs: list[dict[str, Any]], node: str) -> list[tuple[str, str]]:
    return [(e["event"], e.get("message", "")) for e in logs if e.get("node") == node]


def test_the_table_is_synced_by_the_first_none_and_beats_wake_dispatch() -> None:
    w, wakes = watcher(Clock())
    w.on_entry(beat("a"))
    assert "a" in w.table.nodes and not w.synced
    w.on_entry(None)
    assert w.synced
    w.on_entry(None)  # a fresh watch after a reconnect: no second wake
    assert len(wakes) == 2  # node.up, synced
    w.on_entry(beat("a", job="j1"))
    assert len(wakes) == 2  # nothing new for dispatch
    w.on_entry(beat("a"))
    assert len(wakes) == 3  # idle again


def test_a_delete_reads_as_a_clean_stop_and_an_expiry_as_a_loss() -> None:
    with capture_logs() as logs:
        w, _ = watcher(Clock())
        w.on_entry(beat("a"))
        w.on_entry(beat("b"))
        w.on_entry(entry("a", operation=KV_DEL))
        w.on_entry(entry("b", operation=KV_PURGE))
    (left,) = [e for e in events(logs, "a") if e[0] != Event.NODE_UP]
    assert left == (Event.NODE_LEFT, "stopped cleanly (heartbeat deleted); last beat 12:00:00 UTC")
    (lost,) = [e for e in events(logs, "b") if e[0] != Event.NODE_UP]
    assert lost == (Event.NODE_LOST, "heartbeat expired; last beat 12:00:00 UTC")
    # Either way the leader fails the jobs held on it, as before.
    assert [n.name for n in w.take_lost()] == ["a", "b"]
    assert w.take_lost() == []
    assert not w.table.nodes["a"].alive and not w.table.nodes["b"].alive


def test_departure_by_operation() -> None:
    assert departure(KV_DEL) is Departure.LEFT
    assert departure(KV_PURGE) is Departure.EXPIRED
    assert departure(None) is None


def test_a_replica_that_does_not_lead_applies_a_deferred_marker_a_timeout_later() -> None:
    """It judges no silence (its majority_at stays 0), so the sweep's
    deferral was its only way to lose a node expired while its view was
    just back: its nodes.list showed the node alive for ever (seen in CI,
    tests/scheduler/test_service.py). A beat since cancels the marker."""
    clock = Clock()
    w, _ = watcher(clock)
    w.on_entry(beat("a"))
    w.on_entry(beat("b"))
    w.reconnected()
    w.on_entry(entry("a", operation=KV_PURGE))
    w.on_entry(entry("b", operation=KV_PURGE))
    clock.now += 1.0
    w.on_entry(beat("b"))  # b lives
    clock.now += TIMEOUT_S + SWEEP_MARGIN_S - 1.0
    w.sweep(clock.now, majority_at=0.0)
    assert not w.table.nodes["a"].alive and w.table.nodes["b"].alive
    assert [n.name for n in w.take_lost()] == ["a"]
    w.sweep(clock.now + TIMEOUT_S, majority_at=0.0)
    assert w.take_lost() == []


def test_a_replica_without_the_lease_leaves_an_expiry_to_the_sweep() -> None:
    """Issue 33 (nemesis seed 8): in a member's cut-off both schedulers were
    between leases, read expiry markers of nodes whose beats came 0.1-1.2 s
    later, and judged them lost (false losses). Without the lease a marker
    waits a node timeout for a beat; with it, it is a loss at once."""
    clock = Clock()
    leading = [False]
    w = NodeWatcher(TIMEOUT_S, clock, structlog.get_logger(), lambda: None, lambda: leading[0])
    w.on_entry(beat("a"))
    w.on_entry(beat("b"))
    with capture_logs() as logs:
        w.on_entry(entry("a", operation=KV_PURGE))
        w.on_entry(entry("b", operation=KV_PURGE))
    assert [e for e, _ in events(logs, "a")] == [Event.NODE_DEPARTURE_DEFERRED]
    assert w.table.nodes["a"].alive and w.take_lost() == []
    clock.now += 0.1
    w.on_entry(beat("a"))  # a lives: its beat came just after the marker
    clock.now += TIMEOUT_S + SWEEP_MARGIN_S
    w.sweep(clock.now, majority_at=0.0)
    assert w.table.nodes["a"].alive, "a beat after the marker, and was lost all the same"
    assert [n.name for n in w.take_lost()] == ["b"]  # b never beat again
    leading[0] = True
    w.on_entry(entry("a", operation=KV_PURGE))
    assert [n.name for n in w.take_lost()] == ["a"]


def test_a_second_marker_for_a_lost_node_changes_nothing() -> None:
    w, _ = watcher(Clock())
    w.on_entry(beat("a"))
    w.on_entry(entry("a", operation=KV_PURGE))
    w.on_entry(entry("a", operation=KV_DEL))
    w.on_entry(entry("nobody", operation=KV_DEL))
    assert [n.name for n in w.take_lost()] == ["a"]


def test_markers_right_after_our_reconnect_are_left_to_the_sweep() -> None:
    clock = Clock()
    w, _ = watcher(clock)
    w.on_entry(beat("a"))
    w.on_entry(beat("b"))
    clock.now += 10.0
    w.reconnected()
    with capture_logs() as logs:
        w.logger = structlog.get_logger()
        w.on_entry(entry("a", operation=KV_PURGE))
        w.on_entry(entry("b", operation=KV_DEL))
    assert w.table.nodes["a"].alive and w.table.nodes["b"].alive
    assert w.take_lost() == []
    # Said as what it is: neither a loss nor a clean stop (found when a log
    # of node.lost for a node never lost failed a cluster test).
    assert [e["event"] for e in logs] == [Event.NODE_DEPARTURE_DEFERRED] * 2
    # The sweep counts from the reconnect, not from the last beat.
    clock.now += TIMEOUT_S
    w.sweep(clock.now)
    assert w.take_lost() == []
    clock.now += SWEEP_MARGIN_S
    with capture_logs() as logs:
        w.logger = structlog.get_logger()
        w.sweep(clock.now)
    assert sorted(n.name for n in w.take_lost()) == ["a", "b"]
    assert {e["event"] for e in logs} == {Event.NODE_LOST}
    assert all(e["message"].startswith("no heartbeat;") for e in logs)
    # Past the grace, a marker counts again.
    w.on_entry(beat("a"))
    w.on_entry(entry("a", operation=KV_PURGE))
    assert [n.name for n in w.take_lost()] == ["a"]


def test_a_bad_heartbeat_is_logged_and_skipped() -> None:
    w, _ = watcher(Clock())
    with capture_logs() as logs:
        w.logger = structlog.get_logger()
        w.on_entry(entry("a", b"not json"))
    assert "a" not in w.table.nodes
    assert logs[0]["event"] == Event.NATS_ERROR and "bad heartbeat" in logs[0]["error"]


def test_a_blind_view_judges_nobody_and_forgives_the_silence_when_it_sees_again() -> None:
    clock = Clock()
    w, _ = watcher(clock)
    w.on_entry(beat("a"))
    w.on_entry(None)
    w.view_changed(True)  # first sight: nothing to forgive
    clock.now += 1.0
    w.view_changed(False)  # the bucket's stream elects a leader
    clock.now += 10.0  # far past the timeout: beats could not be stored, nor seen
    w.sweep(clock.now)
    w.on_entry(entry("a", operation=KV_PURGE))  # the new leader expires the old beat
    assert w.take_lost() == [] and w.table.nodes["a"].alive
    w.view_changed(True)
    # Counted from the moment the view came back, not from the last beat.
    clock.now += TIMEOUT_S
    w.sweep(clock.now)
    assert w.take_lost() == []
    clock.now += SWEEP_MARGIN_S
    w.sweep(clock.now)
    assert [n.name for n in w.take_lost()] == ["a"]


def test_a_node_silent_while_the_view_sees_is_lost_on_time() -> None:
    clock = Clock()
    w, _ = watcher(clock)
    w.on_entry(beat("a"))
    w.on_entry(None)
    w.view_changed(True)
    w.view_changed(True)  # the same verdict again forgives nothing
    clock.now += TIMEOUT_S + SWEEP_MARGIN_S
    w.sweep(clock.now)
    assert [n.name for n in w.take_lost()] == ["a"]


def test_a_blind_watch_is_rebuilt_only_when_it_delivers_nothing() -> None:
    clock = Clock()
    views: list[bool] = []
    watch = KeyWatch(
        None,  # type: ignore[arg-type]  # judge() alone never touches JetStream
        "lorafleet_nodes",
        ">",
        lambda _e: None,
        structlog.get_logger(),
        on_view=views.append,
        clock=clock,
    )
    restarts: list[float] = []
    watch.restart = lambda: restarts.append(clock.now)  # type: ignore[method-assign]
    watch._built_at = clock.now  # as start() does
    watch.judge(None)
    assert views == [True]  # first sight
    watch.judge("its consumer does not answer")
    assert views == [True, False] and restarts == []  # not blind long enough yet
    clock.now += REBUILD_AFTER_S
    watch._entry_at = clock.now - 0.1  # entries still arrive: the watch lives
    watch.judge("the watch has not delivered the bucket's content yet")
    assert restarts == []
    clock.now += REBUILD_AFTER_S
    watch.judge("its consumer does not answer")
    assert restarts == [clock.now] and watch.rebuilds == 1
    watch.judge(None)
    assert views == [True, False, True]


def test_the_sweep_judges_silence_as_of_the_last_write_that_reached_the_majority() -> None:
    """Nemesis seed 3: on a member cut off from the others, no beat comes and
    every read still answers; only the lease's writes fail. A node silent
    past the timeout as of that last write is lost; one silent only since, not."""
    clock = Clock()
    w, _ = watcher(clock)
    w.on_entry(beat("a"))
    w.on_entry(None)
    seen = clock.now
    clock.now += 10 * TIMEOUT_S
    w.sweep(clock.now, majority_at=seen + 1.0)  # cut off a second after the beat
    assert w.take_lost() == [] and w.table.nodes["a"].alive
    w.sweep(clock.now, majority_at=seen + TIMEOUT_S + SWEEP_MARGIN_S + 0.1)
    assert [n.name for n in w.take_lost()] == ["a"]


def test_a_watch_reading_a_copy_behind_the_leader_is_blind() -> None:
    """Nemesis seed 3's test: a member back from a cut answers while its copy
    of the bucket catches up; a watch whose consumer is on it sees no beat."""

    def infos(host: str, current: bool) -> tuple[ConsumerInfo, StreamInfo]:
        peers = [PeerInfo(name="nats-2", current=current), PeerInfo(name="nats-3", current=True)]
        consumer = ConsumerInfo(
            name="c", stream_name="s", config=ConsumerConfig(), created=None,  # type: ignore[arg-type]
            cluster=ClusterInfo(leader=host),
        )  # fmt: skip
        stream = StreamInfo(
            config=StreamConfig(name="s"), state=None,  # type: ignore[arg-type]
            cluster=ClusterInfo(leader="nats-1", replicas=peers),
        )  # fmt: skip
        return consumer, stream

    assert "nats-2" in (behind(*infos("nats-2", current=False)) or "")
    assert behind(*infos("nats-2", current=True)) is None
    assert behind(*infos("nats-1", current=False)) is None  # on the leader itself


def test_a_watch_whose_consumer_stops_sending_is_blind() -> None:
    """Nemesis seeds 4 and 5: after a member's restart a watch's consumer
    answered and sent nothing for 13 s while the leader held the beats."""
    watch = KeyWatch(None, "lorafleet_nodes", ">", lambda _e: None, structlog.get_logger())  # type: ignore[arg-type]

    def probe(delivered: int, last: int) -> str | None:
        consumer = ConsumerInfo(
            name="c", stream_name="s", config=ConsumerConfig(), created=None,  # type: ignore[arg-type]
            delivered=SequenceInfo(consumer_seq=delivered, stream_seq=delivered),
        )  # fmt: skip
        stream = StreamInfo(
            config=StreamConfig(name="s"),
            state=StreamState(messages=last, bytes=0, first_seq=1, last_seq=last, consumer_count=1),
        )
        return watch.stalled(consumer, stream)

    assert probe(10, 10) is None
    assert probe(10, 10) is None  # nothing new to send: no stall
    assert probe(10, 12) is None  # one probe could fall between a store and its send
    assert probe(10, 13) is not None  # a second in a row: stalled
    assert probe(14, 14) is None  # it sends again


def test_an_older_beat_delivered_late_changes_nothing() -> None:
    """bench/nemesis.py, seed 5: while the scheduler's view was blind, a
    rebuilt watch on a copy behind delivered the node's beat from before a
    dispatch; taken as news, the node "ran no job" a second after it was sent
    one, and reconcile failed the job while its trainer ran (the one-node
    rule: two attempts at once). A stale entry (its revision no newer than
    the key's last) is dropped, beat or departure."""
    clock = Clock()
    w, _ = watcher(clock)
    before = beat("a", revision=10)
    w.on_entry(before)
    w.on_entry(None)
    w.on_entry(beat("a", job="j1", revision=11))
    seen_at = w.table.nodes["a"].last_seen
    clock.now += 1.0
    w.on_entry(before)  # delivered again, late
    node = w.table.nodes["a"]
    assert node.running == "j1" and node.last_seen == seen_at
    w.on_entry(entry("a", operation=KV_PURGE, revision=9))
    assert w.table.nodes["a"].alive
