"""Where adapters with a serving policy go (scheduler/replicas.py): plain
functions over the node table, no bus."""

from __future__ import annotations

import datetime as dt

import pytest

from lorafleet.fleet_serving import policy_of, served_adapter_name
from lorafleet_schemas.messages import (
    ArtifactKind,
    CheckpointRef,
    Engine,
    EngineRef,
    Heartbeat,
    JobState,
    ModelRecord,
    NodeSchedule,
    Replicas,
    ServingPolicy,
    ServingRecord,
    ServingState,
)
from lorafleet_services.scheduler.node_table import NodeTable
from lorafleet_services.scheduler.placement import plan_dispatch
from lorafleet_services.scheduler.replicas import (
    ASK_AGAIN_S,
    LOADING_STALE_S,
    NOT_STARTED_AGAIN_S,
    REFUSED_AGAIN_S,
    Asks,
    Placed,
    desired_nodes,
    holders,
    plan_replicas,
    rendezvous,
)
from tests.records import T0, job_record

SHA = "ab" * 32
MODEL = ModelRecord(
    name="tiny", engine=Engine.VLLM, hf_repo=None, hf_revision="main",
    local_dir="/models/tiny", description="", created_at=T0,
)  # fmt: skip


def engine(url: str, adapters: list[str] | None = None, slots: int | None = 4) -> EngineRef:
    return EngineRef(kind=Engine.VLLM, url=url, model="/models/tiny", max_cpu_loras=slots,
                     adapters=adapters or [])  # fmt: skip


def fleet(*nodes: tuple[str, list[EngineRef]], now: float = 10.0) -> NodeTable:
    t = NodeTable()
    for name, engines in nodes:
        t.beat(Heartbeat(node=name, version="t", started_at=T0, time=T0, serving=engines), now)
    return t


def placed(job_id: str = "j1", policy: ServingPolicy = "all", minute: int = 0) -> Placed:
    ref = CheckpointRef(job_id=job_id, kind=ArtifactKind.PEFT, object=f"{job_id}/peft",
                        size=1, sha256=SHA)  # fmt: skip
    job = job_record(id=job_id, state=JobState.DONE, adapter=ref,
                     created_at=T0 + dt.timedelta(minutes=minute))  # fmt: skip
    return Placed(job, MODEL, policy)


def record(job_id: str, node: str, state: ServingState) -> ServingRecord:
    return ServingRecord(
        job_id=job_id, node=node, engine=f"http://{node}:8000", engine_kind=Engine.VLLM,
        model="tiny", served_name=served_adapter_name(job_id, SHA), sha256=SHA, state=state,
        created_at=T0, updated_at=T0,
    )  # fmt: skip


def name(job_id: str = "j1") -> str:
    return served_adapter_name(job_id, SHA)


def test_rendezvous_moves_about_one_in_n_keys_when_a_node_joins() -> None:
    """HRW: a fourth node takes only the keys it now ranks first for (~1/4);
    the others keep theirs. Pure rendezvous, without the stickiness."""
    keys = [f"job-{i}" for i in range(2000)]
    three = {k: rendezvous(k, ["a", "b", "c"], 1)[0] for k in keys}
    four = {k: rendezvous(k, ["a", "b", "c", "d"], 1)[0] for k in keys}
    moved = [k for k in keys if three[k] != four[k]]
    assert all(four[k] == "d" for k in moved)
    assert 0.18 < len(moved) / len(keys) < 0.32, len(moved)
    # Every node gets a share: the hash spreads.
    assert {three[k] for k in keys} == {"a", "b", "c"}


def test_rendezvous_is_the_same_whatever_the_order_of_the_nodes() -> None:
    assert rendezvous("j1", ["a", "b", "c"], 2) == rendezvous("j1", ["c", "a", "b"], 2)


def test_all_goes_to_every_live_node_with_an_engine_of_the_base() -> None:
    t = fleet(("a", [engine("http://a")]), ("b", [engine("http://b")]), ("c", []))
    other = EngineRef(kind=Engine.VLLM, url="http://d", model="/models/other")
    t.beat(Heartbeat(node="d", version="t", started_at=T0, time=T0, serving=[other]), 10.0)
    t.expire("b")
    plan = plan_replicas([placed()], t.nodes, [])
    assert plan.place == [("j1", "a")]


def test_replicas_two_of_three_and_stable_when_a_node_joins() -> None:
    nodes = [("a", [engine("http://a")]), ("b", [engine("http://b")])]
    t = fleet(*nodes)
    first = plan_replicas([placed(policy=Replicas(replicas=2))], t.nodes, [])
    assert sorted(first.place) == [("j1", "a"), ("j1", "b")]
    # Both served; a third node joins, ranked first by the hash for some job.
    served = [(n, [engine(f"http://{n}", [name()])]) for n in ("a", "b")]
    for joiner in ("c", "d", "e", "f"):
        t = fleet(*served, (joiner, [engine(f"http://{joiner}")]))
        plan = plan_replicas([placed(policy=Replicas(replicas=2))], t.nodes, [])
        assert plan.place == [] and plan.unplace == [], joiner
        assert sorted(plan.desired["j1"]) == ["a", "b"]


def test_a_lost_node_s_replica_is_placed_on_the_next_by_the_hash() -> None:
    policy = Replicas(replicas=2)
    t = fleet(*[(n, [engine(f"http://{n}", [name()] if n in "ab" else [])]) for n in "abcd"])
    t.expire("a")
    plan = plan_replicas([placed(policy=policy)], t.nodes, [])
    expected = rendezvous("j1", ["c", "d"], 1)
    assert plan.place == [("j1", expected[0])]
    assert plan.unplace == []


def test_a_node_full_of_placed_replicas_is_no_candidate() -> None:
    policy = Replicas(replicas=2)
    others = [placed("x", "all"), placed("y", "all")]
    full = engine("http://b", [name("x"), name("y")], slots=2)
    t = fleet(("a", [engine("http://a")]), ("b", [full]), ("c", [engine("http://c")]))
    plan = plan_replicas([placed(policy=policy), *others], t.nodes, [])
    assert sorted(n for j, n in plan.place if j == "j1") == ["a", "c"]
    # Adapters no policy placed (evictable by the agent) leave the slots free.
    t = fleet(("b", [engine("http://b", ["auto-1", "auto-2"], slots=2)]))
    assert plan_replicas([placed(policy=policy)], t.nodes, []).place == [("j1", "b")]
    # Slots are counted across jobs: one slot left on c goes to the older job.
    one = engine("http://c", [], slots=1)
    t = fleet(("c", [one]))
    older, newer = placed("j1", Replicas(replicas=1), 0), placed("j2", Replicas(replicas=1), 5)
    plan = plan_replicas([newer, older], t.nodes, [])
    assert plan.place == [("j1", "c")]


def test_n_replicas_pass_over_a_node_that_refused_the_version() -> None:
    t = fleet(*[(n, [engine(f"http://{n}")]) for n in "abc"])
    [top] = rendezvous("j1", ["a", "b", "c"], 1)
    plan = plan_replicas([placed(policy=Replicas(replicas=1))], t.nodes,
                         [record("j1", top, ServingState.REFUSED)])  # fmt: skip
    assert len(plan.place) == 1 and plan.place[0][1] != top
    # `all` asks it again (its refusal may have been lifted).
    plan = plan_replicas([placed()], t.nodes, [record("j1", top, ServingState.FAILED)])
    assert ("j1", top) in plan.place


def test_n_replicas_ask_a_refusing_node_again_when_too_few_others_can_take_it() -> None:
    """Seed 14: a load that failed while its engine was down or restarting
    marked the node refusing for good; two such failures left a job of two
    replicas on one node. A refusing node is asked again when the others
    cannot fill the replicas (the caller's back-off paces the asking)."""
    t = fleet(*[(n, [engine(f"http://{n}")]) for n in "abc"])
    failed = [record("j1", n, ServingState.FAILED) for n in "ab"]
    plan = plan_replicas([placed(policy=Replicas(replicas=2))], t.nodes, failed)
    assert plan.desired["j1"][0] == "c" and len(plan.desired["j1"]) == 2
    assert ("j1", "c") in plan.place and len(plan.place) == 2
    # With enough others, the refusing one is still passed over.
    plan = plan_replicas([placed(policy=Replicas(replicas=1))], t.nodes, failed)
    assert plan.place == [("j1", "c")]


def test_loading_is_not_asked_again_and_asked_pairs_wait() -> None:
    t = fleet(("a", [engine("http://a")]), ("b", [engine("http://b")]))
    plan = plan_replicas([placed()], t.nodes, [record("j1", "a", ServingState.LOADING)],
                         recently_asked={("j1", "b")})  # fmt: skip
    assert plan.place == []


def test_a_load_left_loading_past_its_bound_is_asked_again() -> None:
    """Nemesis seed 44: an agent SIGTERMed mid-load left its record loading,
    and the `all` job never went back on that node (35 minutes, to the run's
    end). A replica counted from such a record is no replica either."""
    t = fleet(("a", [engine("http://a")]), ("b", [engine("http://b")]))
    stuck = [record("j1", "a", ServingState.LOADING)]  # updated at T0
    soon = T0 + dt.timedelta(seconds=LOADING_STALE_S - 1)
    late = T0 + dt.timedelta(seconds=LOADING_STALE_S + 1)
    assert plan_replicas([placed()], t.nodes, stuck, wall=soon).place == [("j1", "b")]
    assert plan_replicas([placed()], t.nodes, stuck, wall=late).place == [("j1", "a"), ("j1", "b")]
    one = placed(policy=Replicas(replicas=1))
    assert plan_replicas([one], t.nodes, stuck, wall=soon).place == []
    assert len(plan_replicas([one], t.nodes, stuck, wall=late).place) == 1


def test_a_new_engine_on_a_node_that_holds_it_gets_it_too() -> None:
    t = fleet(("a", [engine("http://a:1", [name()]), engine("http://a:2")]))
    complete, holding, _ = holders(placed(), t.nodes, [])
    assert complete == set() and holding == {"a"}
    assert plan_replicas([placed()], t.nodes, []).place == [("j1", "a")]


def test_drain_places_elsewhere_first_then_unloads() -> None:
    policy = Replicas(replicas=1)
    t = fleet(("a", [engine("http://a", [name()])]), ("b", [engine("http://b")]))
    t.mark("a", NodeSchedule.DRAINED)
    plan = plan_replicas([placed(policy=policy)], t.nodes, [])
    assert plan.place == [("j1", "b")] and plan.unplace == []
    t = fleet(("a", [engine("http://a", [name()])]), ("b", [engine("http://b", [name()])]))
    t.mark("a", NodeSchedule.DRAINED)
    plan = plan_replicas([placed(policy=policy)], t.nodes, [])
    assert plan.place == [] and plan.unplace == [("j1", "a")]


def test_a_node_whose_engine_is_missing_from_its_beat_is_not_asked_to_unload() -> None:
    """Nemesis seed 44: an engine down or too slow to read for a beat took
    its node out of an `all` job's desired nodes, and the scheduler asked it
    to unload every such adapter; its agent then no longer loaded them back
    when the engine returned. A drained node with its engine is still asked."""
    served = [record("j1", "a", ServingState.SERVED)]
    t = fleet(("a", []), ("b", [engine("http://b", [name()])]))
    assert plan_replicas([placed()], t.nodes, served).unplace == []
    t = fleet(("a", [engine("http://a", [name()])]), ("b", [engine("http://b", [name()])]))
    t.mark("a", NodeSchedule.DRAINED)
    assert plan_replicas([placed()], t.nodes, served).unplace == [("j1", "a")]


def test_the_last_replica_stays_when_nowhere_else_can_serve_it() -> None:
    t = fleet(("a", [engine("http://a", [name()])]))
    t.mark("a", NodeSchedule.DRAINED)
    plan = plan_replicas([placed()], t.nodes, [])
    assert plan.desired["j1"] == [] and plan.unplace == [] and plan.place == []


def test_a_surplus_replica_goes_once_the_desired_ones_serve() -> None:
    t = fleet(*[(n, [engine(f"http://{n}", [name()])]) for n in "abc"])
    plan = plan_replicas([placed(policy=Replicas(replicas=2))], t.nodes, [])
    kept = rendezvous("j1", ["a", "b", "c"], 2)
    assert plan.unplace == [("j1", next(n for n in "abc" if n not in kept))]


def test_cordoned_serves_on_and_takes_no_new_job() -> None:
    t = fleet(("a", [engine("http://a")]))
    t.mark("a", NodeSchedule.CORDONED)
    assert desired_nodes(placed(), t.nodes, set(), {}) == ["a"]
    t.nodes["a"].heartbeat.cpu_training = True
    plan = plan_dispatch([job_record(id="q")], t.nodes, {}, 0.0)
    assert plan.send == [] and "cordoned" in plan.waiting["q"]
    plan = plan_dispatch([job_record(id="q", node="a")], t.nodes, {}, 0.0)
    assert plan.send == [] and "uncordon a" in plan.waiting["q"]
    t.mark("a", NodeSchedule.OPEN)
    assert plan_dispatch([job_record(id="q")], t.nodes, {}, 0.0).send != []


def test_a_mark_given_before_the_first_beat_holds_at_it() -> None:
    t = NodeTable()
    t.mark("late", NodeSchedule.DRAINED)
    t.beat(Heartbeat(node="late", version="t", started_at=T0, time=T0), 1.0)
    assert t.nodes["late"].schedule is NodeSchedule.DRAINED
    assert t.infos()[0].schedule is NodeSchedule.DRAINED


@pytest.mark.parametrize(
    ("job_policy", "serve", "model_policy", "expected"),
    [
        (None, None, None, None),
        (None, None, "all", "all"),
        (Replicas(replicas=2), None, "all", Replicas(replicas=2)),
        ("all", False, "all", None),
    ],
)
def test_the_policy_is_the_job_s_else_the_model_s(
    job_policy: ServingPolicy | None,
    serve: bool | None,
    model_policy: ServingPolicy | None,
    expected: ServingPolicy | None,
) -> None:
    import msgspec

    job = job_record(serving=job_policy, serve=serve)
    model = msgspec.structs.replace(MODEL, serving=model_policy)
    assert policy_of(job, model) == expected


def test_an_ask_waits_for_its_load_and_one_that_started_nothing_does_not() -> None:
    asks = Asks()
    loading, idle = ("j1", "n1", "place"), ("j1", "n2", "place")
    for key in (loading, idle):
        asks.ask(key, 100.0, T0)
    asks.not_started(idle, 100.5)  # n2 saw no engine of the base yet
    assert asks.pending("place", 100.0 + NOT_STARTED_AGAIN_S) == {("j1", "n1"), ("j1", "n2")}
    assert asks.pending("place", 100.5 + NOT_STARTED_AGAIN_S) == {("j1", "n1")}
    assert asks.pending("place", 100.0 + ASK_AGAIN_S - 0.1) == {("j1", "n1")}
    assert asks.pending("place", 100.0 + ASK_AGAIN_S) == set()


def test_a_load_refused_after_its_ask_is_asked_again_soon_and_an_older_one_not() -> None:
    asks = Asks()
    asks.ask(("j1", "n1", "place"), 100.0, T0 + dt.timedelta(seconds=10))
    older = record("j1", "n1", ServingState.FAILED)  # updated_at T0: before the ask
    asks.heard([older, record("j1", "n1", ServingState.SERVED)], 101.0)
    assert asks.pending("place", 101.0 + REFUSED_AGAIN_S) == {("j1", "n1")}
    newer = record("j1", "n1", ServingState.REFUSED)
    newer.updated_at = T0 + dt.timedelta(seconds=11)
    asks.heard([newer], 101.0)
    assert asks.pending("place", 101.0 + REFUSED_AGAIN_S - 0.1) == {("j1", "n1")}
    assert asks.pending("place", 101.0 + REFUSED_AGAIN_S) == set()
