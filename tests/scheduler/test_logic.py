"""The scheduler's rules, with a hand-driven clock and no bus."""

from __future__ import annotations

import datetime as dt

import msgspec
import pytest

from lorafleet.errors import BadRequestError, ConflictError
from lorafleet_schemas.messages import (
    Card,
    CheckpointRef,
    Heartbeat,
    JobRecord,
    JobState,
    NodeSchedule,
    NodeScheduleRequest,
)
from lorafleet_services.scheduler import node_table, placement
from lorafleet_services.scheduler import reconcile as reconcile_mod
from lorafleet_services.scheduler.node_marks import check_request, plan_moves
from lorafleet_services.scheduler.node_table import BeatChange, Node, NodeTable, lost_nodes
from lorafleet_services.scheduler.placement import busy_nodes, plan_dispatch
from lorafleet_services.scheduler.reconcile import LET_GO_GRACE_S, Taken, reconcile
from tests.records import job_record

T0 = dt.datetime(2026, 11, 29, 12, 0, 0, tzinfo=dt.UTC)


def hb(
    node: str,
    *,
    cards: list[tuple[int, int]] | None = None,
    job: str | None = None,
    cpu: bool = False,
    started_at: dt.datetime = T0,
    time: dt.datetime = T0,
    beat: int = 0,
) -> Heartbeat:
    """A heartbeat; `cards` is [(total_mib, free_mib)] by index."""
    return Heartbeat(
        node=node,
        version="0.1.0",
        started_at=started_at,
        time=time,
        cards=[
            Card(index=i, name=f"Card {i}", total_mib=total, free_mib=free)
            for i, (total, free) in enumerate(cards or [])
        ],
        job=job,
        cpu_training=cpu,
        beat=beat,
    )


def job(
    job_id: str,
    *,
    node: str | None = None,
    mib: int = 1000,
    state: JobState = JobState.QUEUED,
    started_at: dt.datetime | None = None,
) -> JobRecord:
    return job_record(
        id=job_id,
        model="m",
        node=node,
        gpu_memory_mib=mib,
        state=state,
        attempt=0,
        created_at=T0,
        updated_at=T0,
        started_at=started_at,
    )


def table(*beats: Heartbeat, now: float = 100.0) -> NodeTable:
    t = NodeTable()
    for b in beats:
        t.beat(b, now)
    return t


# --- the node table ---------------------------------------------------------


def test_beats_report_up_idle_and_same() -> None:
    t = NodeTable()
    assert t.beat(hb("a"), 1.0) is BeatChange.UP
    assert t.beat(hb("a"), 2.0) is BeatChange.SAME
    assert t.beat(hb("a", job="j1"), 3.0) is BeatChange.SAME
    assert t.beat(hb("a"), 4.0) is BeatChange.IDLE
    assert t.nodes["a"].last_seen == 4.0


def test_expire_marks_lost_once_and_a_new_beat_brings_it_back() -> None:
    t = table(hb("a"))
    lost = t.expire("a")
    assert lost is not None and lost.name == "a"
    assert not t.nodes["a"].alive
    assert t.expire("a") is None  # already lost
    assert t.expire("nobody") is None
    assert t.beat(hb("a"), 200.0) is BeatChange.UP
    assert t.nodes["a"].alive


def test_lost_nodes_by_silence() -> None:
    nodes = [
        Node(heartbeat=hb("old"), last_seen=10.0),
        Node(heartbeat=hb("fresh"), last_seen=12.5),
        Node(heartbeat=hb("gone"), last_seen=0.0, alive=False),
    ]
    assert [n.name for n in lost_nodes(nodes, 13.0, 3.0)] == ["old"]
    assert lost_nodes(nodes, 12.9, 3.0) == []


def test_sweep_waits_for_the_margin_and_marks_lost() -> None:
    t = table(hb("a"), now=10.0)
    assert t.sweep(13.0, 3) == []  # the expiry marker is the primary signal
    lost = t.sweep(13.0 + node_table.SWEEP_MARGIN_S, 3)
    assert [n.name for n in lost] == ["a"]
    assert t.sweep(20.0, 3) == []  # once


def test_touch_all_forgives_our_own_outage() -> None:
    t = table(hb("a"), now=10.0)
    t.touch_all(30.0)
    assert t.sweep(31.0, 3) == []


# --- dispatch ---------------------------------------------------------------


def test_named_job_goes_to_its_idle_node() -> None:
    t = table(hb("a", cards=[(24000, 20000)]))
    plan = plan_dispatch([job("j1", node="a", mib=8000)], t.nodes, {}, 100.0)
    assert [(j.id, n) for j, n in plan.send] == [("j1", "a")]
    assert plan.waiting == {}


def test_one_job_per_node_oldest_first() -> None:
    t = table(hb("a", cpu=True))
    plan = plan_dispatch([job("old", node="a"), job("new", node="a")], t.nodes, {}, 100.0)
    assert [j.id for j, _ in plan.send] == ["old"]
    assert "new" in plan.waiting and "a" in plan.waiting["new"]


def test_named_job_waits_for_unknown_offline_and_busy_nodes() -> None:
    t = table(hb("busy", cpu=True, job="other"), hb("held", cpu=True), hb("dead", cpu=True))
    t.expire("dead")
    jobs = [
        job("j-unknown", node="ghost"),
        job("j-dead", node="dead"),
        job("j-busy", node="busy"),
        job("j-held", node="held"),
    ]
    plan = plan_dispatch(jobs, t.nodes, {"held": "running-job"}, 100.0)
    assert plan.send == []
    assert "ghost" in plan.waiting["j-unknown"] and "no agent" in plan.waiting["j-unknown"]
    assert "stopped heartbeating" in plan.waiting["j-dead"]
    assert "12:00:00 UTC" in plan.waiting["j-dead"]
    assert "busy with job other" in plan.waiting["j-busy"]
    assert "busy with job running-job" in plan.waiting["j-held"]


def test_named_job_larger_than_any_card_says_so() -> None:
    t = table(hb("gpu-1", cards=[(24000, 24000), (16000, 16000)]))
    plan = plan_dispatch([job("big", node="gpu-1", mib=30000)], t.nodes, {}, 100.0)
    assert plan.send == []
    msg = plan.waiting["big"]
    assert "no card on gpu-1 has 30000 MiB" in msg
    assert "GPU 0" in msg and "24000 MiB" in msg


def test_named_job_waits_for_free_memory() -> None:
    t = table(hb("gpu-1", cards=[(24000, 5000)]))
    plan = plan_dispatch([job("j", node="gpu-1", mib=8000)], t.nodes, {}, 100.0)
    assert plan.send == []
    assert "8000 MiB free" in plan.waiting["j"] and "5000" in plan.waiting["j"]


def test_named_card_less_node_without_cpu_training_waits() -> None:
    t = table(hb("n"))
    plan = plan_dispatch([job("j", node="n")], t.nodes, {}, 100.0)
    assert plan.send == [] and "no cards" in plan.waiting["j"]


def test_unplaced_job_goes_to_the_most_free_card() -> None:
    t = table(
        hb("small", cards=[(24000, 9000)]),
        hb("large", cards=[(80000, 70000), (80000, 10000)]),
        hb("mid", cards=[(48000, 40000)]),
        hb("cpu", cpu=True),
    )
    plan = plan_dispatch([job("a", mib=8000), job("b", mib=8000)], t.nodes, {}, 100.0)
    assert [(j.id, n) for j, n in plan.send] == [("a", "large"), ("b", "mid")]


def test_unplaced_job_skips_busy_dead_and_small_nodes() -> None:
    t = table(
        hb("busy", cards=[(80000, 80000)], job="x"),
        hb("held", cards=[(80000, 80000)]),
        hb("dead", cards=[(80000, 80000)]),
        hb("small", cards=[(24000, 4000)]),
    )
    t.expire("dead")
    plan = plan_dispatch([job("a", mib=8000)], t.nodes, {"held": "y"}, 100.0)
    assert plan.send == []
    assert "8000 MiB free" in plan.waiting["a"]


def test_cpu_node_takes_unplaced_jobs_only_when_no_card_node_is_alive() -> None:
    t = table(hb("cpu", cpu=True), hb("gpu", cards=[(24000, 1000)]))
    plan = plan_dispatch([job("a", mib=8000)], t.nodes, {}, 100.0)
    assert plan.send == []  # a card node is alive: wait for it
    t.expire("gpu")
    plan = plan_dispatch([job("a", mib=8000)], t.nodes, {}, 100.0)
    assert [(j.id, n) for j, n in plan.send] == [("a", "cpu")]


def test_no_node_at_all() -> None:
    plan = plan_dispatch([job("a")], {}, {}, 100.0)
    assert plan.send == [] and "no node is heartbeating" in plan.waiting["a"]


def test_busy_nodes_ignore_delivered_uploads() -> None:
    t = table(hb("a", cpu=True), hb("b", cpu=True, job="up2"))
    sent = T0 + dt.timedelta(seconds=5)  # sent after the agent started: not restarted
    jobs = [
        job("up1", node="a", state=JobState.UPLOADING, started_at=sent),
        job("up2", node="b", state=JobState.UPLOADING, started_at=sent),
        job("run", node="c", state=JobState.RUNNING),
    ]
    assert busy_nodes(jobs, t.nodes) == {"b": "up2", "c": "run"}


# --- reconcile --------------------------------------------------------------


def test_reconcile_fails_a_job_the_agent_does_not_run_after_the_grace() -> None:
    t = table(hb("a", cpu=True), now=100.0)
    running = job("j", node="a", state=JobState.RUNNING)
    first_seen = {"j": 99.0}
    assert reconcile([running], t.nodes, 100.5, first_seen).fail == []  # within grace
    t.beat(hb("a", cpu=True), 101.5)
    result = reconcile([running], t.nodes, 101.5, first_seen)
    assert [f.job.id for f in result.fail] == ["j"]
    assert "the agent on a restarted" in result.fail[0].message


def test_reconcile_needs_a_beat_newer_than_the_dispatch() -> None:
    t = table(hb("a", cpu=True), now=100.0)
    starting = job("j", node="a", state=JobState.STARTING)
    # Dispatched at 100.2, after the last beat: wait for a later beat even past the grace.
    assert reconcile([starting], t.nodes, 105.0, {"j": 100.2}).fail == []


def test_reconcile_ignores_a_beat_composed_before_the_agent_took_the_job() -> None:
    """Seed 15: the agent's beats failed for 4 s on a cut-off member; one
    composed before it took the job reached the bucket after the dispatch
    and read as "the agent no longer runs the job": the job ran on two nodes.
    A beat is news of the job only when composed after the agent's accept."""
    t = table(hb("a", cpu=True), now=100.0)
    running = job("j", node="a", state=JobState.RUNNING)
    took = T0 + dt.timedelta(seconds=10)
    stale = hb("a", cpu=True, time=took - dt.timedelta(seconds=2))
    t.beat(stale, 103.3)  # received 3.3 s after the dispatch, past the grace
    taken = {"j": Taken(took)}  # an older agent's reply: its clock only
    assert reconcile([running], t.nodes, 103.3, {"j": 100.0}, taken=taken).fail == []
    # without the agent's accept time it is taken as news (as before)
    assert [f.job.id for f in reconcile([running], t.nodes, 103.3, {"j": 100.0}).fail] == ["j"]
    # a beat composed after the accept that lacks the job is a loss
    t.beat(hb("a", cpu=True, time=took + dt.timedelta(seconds=1)), 104.0)
    result = reconcile([running], t.nodes, 104.0, {"j": 100.0}, taken=taken)
    assert [f.job.id for f in result.fail] == ["j"]


def test_a_beat_is_before_or_after_the_take_by_its_count_not_the_nodes_clock() -> None:
    """The node's clock stepped back an hour after the agent took the job:
    by the clock every beat of the next hour was "before" the take, and a
    job the agent had lost stayed running. The beat count has no clock."""
    took = T0 + dt.timedelta(hours=1)
    taken = {"j": Taken(took, agent_started_at=T0, beat=7)}
    running = job("j", node="a", state=JobState.RUNNING)
    stepped_back = T0 + dt.timedelta(seconds=5)
    t = table(hb("a", cpu=True), now=100.0)
    t.beat(hb("a", cpu=True, time=stepped_back, beat=7), 103.3)  # composed before the take
    assert reconcile([running], t.nodes, 103.3, {"j": 100.0}, taken=taken).fail == []
    t.beat(hb("a", cpu=True, time=stepped_back, beat=8), 104.0)  # after it, without the job
    result = reconcile([running], t.nodes, 104.0, {"j": 100.0}, taken=taken)
    assert [f.job.id for f in result.fail] == ["j"]
    # Another agent process (restarted since) without the job: after, whatever its count.
    restarted = hb("a", cpu=True, started_at=T0 + dt.timedelta(seconds=1), beat=2)
    t.beat(restarted, 104.0)
    result = reconcile([running], t.nodes, 104.0, {"j": 100.0}, taken=taken)
    assert [f.job.id for f in result.fail] == ["j"]


def test_reconcile_after_our_view_came_back_waits_for_a_fresh_beat() -> None:
    # A beat from before the dispatch, then blindness (a cluster's election);
    # when the view comes back every node counts as just seen: that is no
    # beat, and the table's stale content must not fail the job.
    t = table(hb("a", cpu=True), now=100.0)
    running = job("j", node="a", state=JobState.RUNNING)
    t.touch_all(110.0)
    assert reconcile([running], t.nodes, 112.0, {"j": 100.2}, view_since=t.touched_at).fail == []
    t.beat(hb("a", cpu=True), 110.5)  # a fresh beat, but not a period after the view
    assert reconcile([running], t.nodes, 112.0, {"j": 100.2}, view_since=t.touched_at).fail == []
    t.beat(hb("a", cpu=True), 112.0)
    result = reconcile([running], t.nodes, 112.0, {"j": 100.2}, view_since=t.touched_at)
    assert [f.job.id for f in result.fail] == ["j"]


def test_reconcile_waits_for_the_final_report_of_a_job_the_agent_let_go() -> None:
    # The agent ended the job and beats with none; the recorder has not applied
    # the final report yet (a status stream electing its leader delays it).
    t = table(hb("a", cpu=True, job="j"), now=100.0)
    running = job("j", node="a", state=JobState.RUNNING)
    t.beat(hb("a", cpu=True), 101.0)
    t.beat(hb("a", cpu=True), 105.0)
    assert reconcile([running], t.nodes, 105.0, {"j": 99.0}).fail == []
    t.beat(hb("a", cpu=True), 101.0 + LET_GO_GRACE_S)
    result = reconcile([running], t.nodes, 101.0 + LET_GO_GRACE_S, {"j": 99.0})
    assert [f.job.id for f in result.fail] == ["j"]


def test_reconcile_keeps_a_job_the_node_runs() -> None:
    t = table(hb("a", cpu=True, job="j"), now=100.0)
    running = job("j", node="a", state=JobState.RUNNING)
    result = reconcile([running], t.nodes, 200.0, {"j": 0.0})
    assert result.fail == [] and result.check == []


def test_reconcile_fails_jobs_on_gone_and_unknown_nodes() -> None:
    t = table(hb("dead", cpu=True, job="j1"))
    t.expire("dead")
    jobs = [
        job("j1", node="dead", state=JobState.RUNNING),
        job("j2", node="ghost", state=JobState.PREPARING),
    ]
    result = reconcile(jobs, t.nodes, 100.0, {})
    msgs = {f.job.id: f.message for f in result.fail}
    assert "node dead stopped heartbeating (last beat 12:00:00 UTC)" in msgs["j1"]
    assert "node ghost is not heartbeating" in msgs["j2"]


def test_reconcile_asks_about_jobs_nodes_run_that_the_recorder_does_not_hold() -> None:
    t = table(hb("a", cpu=True, job="stale"), hb("b", cpu=True, job="j"))
    result = reconcile([job("j", node="b", state=JobState.RUNNING)], t.nodes, 100.0, {})
    assert [(c.node, c.job_id) for c in result.check] == [("a", "stale")]
    assert reconcile_mod.should_cancel_on_node(job("stale", state=JobState.CANCELLED))
    assert reconcile_mod.should_cancel_on_node(None)
    assert not reconcile_mod.should_cancel_on_node(job("stale", state=JobState.STARTING))


def test_uploading_job_after_delivery_is_kept_unless_the_agent_restarted() -> None:
    sent = T0 + dt.timedelta(seconds=5)
    uploading = job("j", node="a", state=JobState.UPLOADING, started_at=sent)
    t = table(hb("a", cpu=True), now=100.0)  # agent started at T0, before the job was sent
    # The scheduler saw the job there at 150, from the same agent process: delivered.
    assert reconcile([uploading], t.nodes, 200.0, {"j": 150.0}).fail == []
    # A new agent process (another started_at) heard at 210: the delivery may be cut short.
    t.beat(hb("a", cpu=True, started_at=T0 + dt.timedelta(seconds=1)), 210.0)
    result = reconcile([uploading], t.nodes, 210.0, {"j": 150.0})
    assert [f.job.id for f in result.fail] == ["j"]


def test_a_delivered_upload_never_stored_is_lost_after_the_store_wait() -> None:
    """Nemesis seed 17: delivered, then neither stored nor failed by the
    artifact-store; the job stayed `uploading` for good. Past the wait it is
    lost (requeued to resume from its checkpoint, or failed), on a live node
    or a gone one; an undelivered job is not judged by this wait."""
    sent = T0 + dt.timedelta(seconds=5)
    uploading = job("j", node="a", state=JobState.UPLOADING, started_at=sent)
    running = job("r", node="b", state=JobState.RUNNING)
    t = table(hb("a", cpu=True), hb("b", cpu=True, job="r"), now=100.0)
    seen, wait_s, delivered = {"j": 150.0, "r": 150.0}, 300.0, {}
    stale = reconcile_mod.deliveries_never_stored
    assert stale([uploading, running], t.nodes, seen, delivered, 160.0, wait_s) == []
    assert delivered == {"j": 160.0}
    assert stale([uploading], t.nodes, seen, delivered, 160.0 + wait_s - 1, wait_s) == []
    [lost] = stale([uploading, running], t.nodes, seen, delivered, 160.0 + wait_s, wait_s)
    assert lost.job.id == "j" and "did not store them within 300 s" in lost.message
    assert "delivered by a" in lost.cause
    t.expire("a")
    [gone] = stale([uploading], t.nodes, seen, delivered, 160.0 + wait_s, wait_s)
    assert gone.message == lost.message
    # A new agent process since: not delivered (the agent lost it), forgotten here.
    t.beat(hb("a", cpu=True, started_at=T0 + dt.timedelta(seconds=60)), 500.0)
    assert stale([uploading], t.nodes, seen, delivered, 600.0, wait_s) == []
    assert delivered == {}


def test_delivered_uploads_by_wall_clock_when_the_scheduler_did_not_see_the_job_sent() -> None:
    sent = T0 + dt.timedelta(seconds=60)
    uploading = job("j", node="a", state=JobState.UPLOADING, started_at=sent)
    # The node's clock runs 3 s ahead: within the skew allowance, not a restart.
    t = table(hb("a", cpu=True, started_at=sent + dt.timedelta(seconds=3)))
    assert placement.is_delivered(uploading, t.nodes["a"])
    # An agent that started well after the job was sent has restarted since.
    later = sent + dt.timedelta(seconds=placement.CLOCK_SKEW_S + 1)
    t.beat(hb("a", cpu=True, started_at=later), 101.0)
    assert not placement.is_delivered(uploading, t.nodes["a"])
    assert [f.job.id for f in reconcile([uploading], t.nodes, 102.0, {}).fail] == ["j"]


def test_the_table_knows_when_each_agent_process_was_first_heard() -> None:
    t = table(hb("a"), now=10.0)
    t.beat(hb("a", job="x"), 11.0)
    assert t.nodes["a"].agent_since == 10.0
    t.beat(hb("a", started_at=T0 + dt.timedelta(seconds=30)), 12.0)
    assert t.nodes["a"].agent_since == 12.0


def test_jobs_lost_with_a_node() -> None:
    t = table(hb("a", cpu=True, job="run"))
    node = t.expire("a")
    assert node is not None
    sent = T0 + dt.timedelta(seconds=5)
    jobs = [
        job("run", node="a", state=JobState.RUNNING),
        job("start", node="a", state=JobState.STARTING),
        job("delivered", node="a", state=JobState.UPLOADING, started_at=sent),
        job("elsewhere", node="b", state=JobState.RUNNING),
    ]
    assert [j.id for j in reconcile_mod.jobs_lost_with(node, jobs)] == ["run", "start"]
    assert "node a stopped heartbeating" in reconcile_mod.node_lost_message(node)


def test_lost_nodes_are_forgotten_after_a_day() -> None:
    t = table(hb("a"), now=10.0)
    t.expire("a")
    t.sweep(10.0 + node_table.FORGET_AFTER_S - 1, 3)
    assert "a" in t.nodes and [i.alive for i in t.infos()] == [False]
    t.sweep(10.0 + node_table.FORGET_AFTER_S + 1, 3)
    assert t.nodes == {}


# --- attempts ----------------------------------------------------------------


def test_a_starting_job_this_scheduler_did_not_send_is_sent_again() -> None:
    t = table(hb("a", cpu=True), now=100.0)
    starting = job("j", node="a", state=JobState.STARTING)
    t.beat(hb("a", cpu=True), 103.0)
    # The leader before this one moved it to starting and died before sending.
    result = reconcile([starting], t.nodes, 103.0, {"j": 100.0}, sent_here=set())
    assert result.fail == [] and [(r.job.id, r.node) for r in result.resend] == [("j", "a")]
    # Sent here (or sent again here) and still not run: the agent lost it.
    result = reconcile([starting], t.nodes, 103.0, {"j": 100.0}, sent_here={"j"})
    assert result.resend == [] and [f.job.id for f in result.fail] == ["j"]
    assert (
        result.fail[0].cause
        == "the agent on a no longer runs the job (it restarted, or the job ended there)"
    )
    # Past starting the agent had it: a loss, whoever sent it.
    preparing = job("j", node="a", state=JobState.PREPARING)
    result = reconcile([preparing], t.nodes, 103.0, {"j": 100.0}, sent_here=set())
    assert result.resend == [] and [f.job.id for f in result.fail] == ["j"]
    # Within the grace nothing happens either way.
    assert reconcile([starting], t.nodes, 100.5, {"j": 100.0}, sent_here=set()).resend == []


def test_a_lost_node_gives_its_jobs_a_cause_for_the_requeue() -> None:
    t = table(hb("a", cpu=True), now=100.0)
    node = t.expire("a")
    assert node is not None
    running = job("j", node="a", state=JobState.RUNNING)
    (lost,) = reconcile([running], t.nodes, 101.0, {}).fail
    assert lost.cause == "node a was lost (last beat 12:00:00 UTC)"
    assert lost.message == reconcile_mod.node_lost_message(node)


def test_resume_ref_prefers_the_own_checkpoint_then_the_others() -> None:
    from lorafleet_schemas.messages import ArtifactKind, CheckpointRef

    def ref(job_id: str, kind: ArtifactKind, step: int) -> CheckpointRef:
        return CheckpointRef(
            job_id=job_id, kind=kind, step=step, object=f"{job_id}/{kind}", size=1, sha256="0" * 64
        )

    own = ref("j", ArtifactKind.CHECKPOINT, 5)
    their_cp, their_peft = ref("o", ArtifactKind.CHECKPOINT, 9), ref("o", ArtifactKind.PEFT, 0)
    other = job_record(id="o", checkpoint=their_cp, adapter=their_peft)
    mine = job_record(id="j", resume_from="o")
    assert (
        reconcile_mod.resume_ref(job_record(id="j", checkpoint=own, resume_from="o"), other) == own
    )
    assert reconcile_mod.resume_ref(mine, other) == their_cp
    assert reconcile_mod.resume_ref(mine, job_record(id="o", adapter=their_peft)) == their_peft
    assert reconcile_mod.resume_ref(mine, job_record(id="o")) is None
    assert reconcile_mod.resume_ref(job_record(id="j"), None) is None


def test_a_node_running_a_requeued_or_moved_job_is_told_to_stop() -> None:
    requeued = job_record(id="j", state=JobState.QUEUED, attempt=1)
    assert reconcile_mod.should_cancel_on_node(requeued)
    assert not reconcile_mod.should_cancel_on_node(
        job_record(id="j", state=JobState.QUEUED, attempt=0)
    )
    moved = job_record(id="j", state=JobState.RUNNING, node="b", attempt=2)
    assert reconcile_mod.should_cancel_on_node(moved, "a")
    assert not reconcile_mod.should_cancel_on_node(moved, "b")


def test_which_training_a_drain_moves() -> None:
    """move_training moves what has training ahead or under way, from a
    checkpoint, off a live node; the rest stays to finish, saying why."""
    cp = CheckpointRef(job_id="r", kind="checkpoint", step=40, object="r/checkpoint", size=1,
                       sha256="0" * 64)  # fmt: skip

    def on_a(job_id: str, state: JobState, step: int = 0, **more: object) -> JobRecord:
        return msgspec.structs.replace(job(job_id, node="a", state=state), step=step, **more)

    running = on_a("r", JobState.RUNNING, 47, checkpoint=cp)
    fresh = on_a("s", JobState.STARTING)
    uploading = on_a("u", JobState.UPLOADING, 80, checkpoint=cp)
    pinned = on_a("p", JobState.RUNNING, 47, checkpoint=cp, requested_node="a")
    bare = on_a("b", JobState.RUNNING, 12)
    elsewhere = msgspec.structs.replace(running, id="x", node="b")
    jobs = [running, fresh, uploading, pinned, bare, elsewhere]
    nodes = table(hb("a", job="r"), hb("b", job="x")).nodes
    moves = reconcile_mod.training_moves
    assert [j.id for j in moves(jobs, nodes, {"a": False})] == ["r", "s"]
    assert [j.id for j in moves(jobs, nodes, {"a": True})] == ["r", "s", "b"]
    assert moves(jobs, nodes, {}) == []
    nodes["a"].alive = False  # a lost node's jobs are the loss's
    assert moves(jobs, nodes, {"a": True}) == []
    why = reconcile_mod.why_training_stays
    assert "its training is over" in (why(uploading, True) or "")
    assert "submitted for node a" in (why(pinned, True) or "")
    assert "lose its 12 steps" in (why(bare, False) or "") and why(bare, True) is None

    drain = NodeScheduleRequest(node="a", schedule=NodeSchedule.DRAINED, move_training=True)
    with pytest.raises(ConflictError, match=r"nothing changed: node a runs job b: .*--force"):
        plan_moves(drain, jobs)
    forced = msgspec.structs.replace(drain, force=True)
    moving, staying = plan_moves(forced, jobs)
    assert moving == ["r", "s", "b"] and set(staying) == {"u", "p"}
    assert plan_moves(msgspec.structs.replace(drain, move_training=False), jobs) == ([], {})
    for bad, field in (
        (NodeScheduleRequest(node="a", schedule=NodeSchedule.CORDONED, move_training=True),
         "move_training"),
        (NodeScheduleRequest(node="a", schedule=NodeSchedule.DRAINED, force=True), "force"),
    ):  # fmt: skip
        with pytest.raises(BadRequestError) as refused:
            check_request(bad)
        assert refused.value.field == f"$.{field}"
    check_request(forced)
