"""Where each finished adapter with a serving policy should be served, as
plain functions over plain data (no bus, no clock).

The desired placement is not stored: it is a function of fleet state the
control plane already keeps (the jobs' and catalog's policies in the
recorder, the heartbeats and node marks in KV, the serving records), so
every scheduler replica computes the same one and the leader reconciles
the nodes toward it each round (`plan_replicas`).

- `all`: every live node, not drained, whose heartbeat lists an engine
  serving the base.
- `{"replicas": N}`: the nodes that hold it stay (placements stay put while
  nodes come and go); the rest are filled by rendezvous hashing (HRW) over
  the candidates with a free adapter slot (one no placed replica holds: the
  agent evicts any other adapter for it), so every replica chooses alike
  and a node that joins or leaves moves only what it must.
- A holder outside the desired set (a drained node, a surplus replica) is
  unloaded only once every desired node serves it: the last replica is
  never taken while nowhere else serves it. A node whose beat lists no
  engine of the base (its engine down or unread) is never asked to unload:
  its agent loads the adapter again when the engine is back.
"""

from __future__ import annotations

import datetime as dt
import hashlib
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field

from lorafleet.fleet_serving import served_adapter_name, serves_base
from lorafleet_schemas.messages import (
    EngineRef,
    JobRecord,
    ModelRecord,
    NodeSchedule,
    Replicas,
    ServingPolicy,
    ServingRecord,
    ServingState,
)
from lorafleet_services.scheduler.node_table import Node

#: Serving states in which a node counts as holding a replica (or about to).
HOLDING = frozenset({ServingState.LOADING, ServingState.SERVED})
#: States in which a node said no to this version: N replicas are filled elsewhere.
REFUSING = frozenset({ServingState.REFUSED, ServingState.FAILED})


def hrw_score(key: str, node: str) -> int:
    """The rendezvous weight of `node` for `key` (64 bits of blake2b: stable
    across processes and Python versions, unlike hash())."""
    digest = hashlib.blake2b(f"{key}\x00{node}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous(key: str, nodes: Iterable[str], n: int) -> list[str]:
    """The `n` nodes of highest weight for `key`, highest first."""
    return sorted(nodes, key=lambda name: (-hrw_score(key, name), name))[:n]


def engines_of(node: Node, model: ModelRecord) -> list[EngineRef]:
    """The engines on `node` whose base is `model`."""
    return [e for e in node.heartbeat.serving if serves_base(e, model)]


def free_slots(engine: EngineRef, pinned: Set[str]) -> int | None:
    """Adapters the engine can still take (`--max-cpu-loras`, else
    `--max-loras`, less the placed replicas it holds: `pinned`, the served
    names of every placed job; any other adapter the agent evicts for a
    placed one); None when its limits are unknown."""
    limit = engine.max_cpu_loras or engine.max_loras
    held = sum(1 for name in engine.adapters if name in pinned)
    return None if limit is None else max(0, limit - held)


@dataclass
class Placed:
    """One job to place: its record, its model and policy."""

    job: JobRecord
    model: ModelRecord
    policy: ServingPolicy

    @property
    def served_name(self) -> str:
        sha = self.job.adapter.sha256 if self.job.adapter is not None else ""
        return served_adapter_name(self.job.id, sha)


@dataclass
class ReplicaPlan:
    """What one round asks of the nodes: (job id, node) pairs."""

    place: list[tuple[str, str]] = field(default_factory=list)
    unplace: list[tuple[str, str]] = field(default_factory=list)
    #: job id -> the nodes it should be served on.
    desired: dict[str, list[str]] = field(default_factory=dict)


def holders(
    placed: Placed, nodes: Mapping[str, Node], records: Sequence[ServingRecord]
) -> tuple[set[str], set[str], set[str]]:
    """Among the live nodes: (complete: every engine of the base lists it in
    the heartbeat; holding: one engine lists it, or a record says it is
    loading or served; loading: a record says it is loading)."""
    name = placed.served_name
    complete: set[str] = set()
    holding: set[str] = set()
    for n in nodes.values():
        if not n.alive:
            continue
        lists = [name in e.adapters for e in engines_of(n, placed.model)]
        if lists and all(lists):
            complete.add(n.name)
        if any(lists):
            holding.add(n.name)
    mine = [
        r
        for r in records
        if r.job_id == placed.job.id
        and r.served_name == name
        and (node := nodes.get(r.node)) is not None
        and node.alive
    ]
    loading = {r.node for r in mine if r.state is ServingState.LOADING}
    return complete, holding | {r.node for r in mine if r.state in HOLDING}, loading


def desired_nodes(
    placed: Placed,
    nodes: Mapping[str, Node],
    holding: set[str],
    slots: Mapping[str, int],
    refusing: Set[str] = frozenset(),
) -> list[str]:
    """Where `placed` should be served (module doc). `slots`: node -> free
    adapter slots in its engines of the base (absent: unknown, taken as free);
    `refusing`: nodes whose engine refused or failed this version, passed
    over when N replicas are filled while other nodes can take it; with too
    few others they are asked again (`all` asks them always): a failure may
    have been the engine down or restarting at the moment (nemesis seed 14:
    two such failures left a job of two replicas on one for good)."""
    candidates = sorted(
        n.name
        for n in nodes.values()
        if n.alive and n.schedule is not NodeSchedule.DRAINED and engines_of(n, placed.model)
    )
    if not isinstance(placed.policy, Replicas):
        return candidates
    want = placed.policy.replicas
    key = placed.job.id
    kept = rendezvous(key, [c for c in candidates if c in holding], want)
    open_ = [c for c in candidates if c not in holding and slots.get(c, 1) > 0]
    chosen = kept + rendezvous(key, [c for c in open_ if c not in refusing], want - len(kept))
    again = [c for c in open_ if c in refusing]
    return chosen + rendezvous(key, again, want - len(chosen))


def node_slots(nodes: Mapping[str, Node], model: ModelRecord, pinned: Set[str]) -> dict[str, int]:
    """node -> free slots over its engines of `model` whose limits are known."""
    out: dict[str, int] = {}
    for n in nodes.values():
        known = [s for e in engines_of(n, model) if (s := free_slots(e, pinned)) is not None]
        if known:
            out[n.name] = sum(known)
    return out


def plan_replicas(
    jobs: Sequence[Placed],
    nodes: Mapping[str, Node],
    records: Sequence[ServingRecord],
    recently_asked: set[tuple[str, str]] | None = None,
    wall: dt.datetime | None = None,
) -> ReplicaPlan:
    """The places to load and to unload in this round, oldest job first (its
    slots are counted before a newer one's). `recently_asked`: (job, node)
    pairs asked lately and not yet answered by a record or a beat (the
    caller's back-off): not asked again. `wall`: the time now, by which a
    record left loading past LOADING_STALE_S stands for no load (None: every
    loading record stands)."""
    asked = recently_asked or set()
    if wall is not None:
        records = [r for r in records if not stale_loading(r, wall)]
    plan = ReplicaPlan()
    slots_by_model: dict[str, dict[str, int]] = {}
    pinned = {p.served_name for p in jobs}
    for placed in sorted(jobs, key=lambda p: p.job.created_at):
        slots = slots_by_model.setdefault(
            placed.model.name, node_slots(nodes, placed.model, pinned)
        )
        complete, holding, loading = holders(placed, nodes, records)
        refusing = {
            r.node
            for r in records
            if r.job_id == placed.job.id
            and r.served_name == placed.served_name
            and r.state in REFUSING
            and r.node not in holding
        }
        desired = desired_nodes(placed, nodes, holding, slots, refusing)
        plan.desired[placed.job.id] = desired
        for node in desired:
            if node in complete or node in loading:
                continue
            if node in slots and node not in holding:
                slots[node] -= 1
            if (placed.job.id, node) not in asked:
                plan.place.append((placed.job.id, node))
        if desired and set(desired) <= complete:
            # Only from a node that lists an engine of the base: one whose
            # engine is missing from its beat (down, or too slow to read) is
            # no surplus, and an unload there dropped the adapter from what
            # its agent loads again (nemesis seed 44: 6,495 unloads asked in
            # bursts, each engine fault emptying an engine of `all` adapters).
            surplus = (
                n for n in sorted(holding - set(desired)) if engines_of(nodes[n], placed.model)
            )
            plan.unplace.extend((placed.job.id, n) for n in surplus)
    return plan


#: Seconds before a (job, node) asked to load or unload is asked again when
#: nothing answered it: past a load and its probe on a busy node.
ASK_AGAIN_S = 30.0
#: Seconds a `loading` record stands for a load under way. Past it with no
#: outcome (its agent stopped mid-load, or the report was lost), the node
#: holds nothing and is asked again: nemesis seed 44's agent, SIGTERMed
#: mid-load, left a record loading that kept an `all` job off its node for
#: the run's last 35 minutes.
LOADING_STALE_S = 2 * ASK_AGAIN_S


def stale_loading(record: ServingRecord, wall: dt.datetime) -> bool:
    """A `loading` record older than LOADING_STALE_S at `wall`."""
    age_s = (wall - record.updated_at).total_seconds()
    return record.state is ServingState.LOADING and age_s > LOADING_STALE_S


#: Seconds before asking again a node that started no load (it did not answer,
#: or its agent saw no engine of the base yet: an agent just started lists its
#: engine in a beat before its serving side has read it): nothing to wait for.
NOT_STARTED_AGAIN_S = 2.0
#: Seconds before asking again a node whose load failed or was refused since
#: the ask (its record says so): soon, since an engine restarting at the
#: moment is the common cause, but not each round.
REFUSED_AGAIN_S = 5.0

#: (job id, node, "place" | "unplace").
AskKey = tuple[str, str, str]


@dataclass
class Asks:
    """The leader's back-off on asking nodes to load or unload: a (job, node)
    asked is not asked again before its time (`ASK_AGAIN_S`, shortened once
    an answer says nothing is under way). `now`: monotonic seconds; records
    carry the recorder's wall clock, so each ask keeps both."""

    #: key -> (monotonic seconds when it may be asked again, wall time asked).
    asked: dict[AskKey, tuple[float, dt.datetime]] = field(default_factory=dict)

    def ask(self, key: AskKey, now: float, wall: dt.datetime) -> None:
        self.asked[key] = (now + ASK_AGAIN_S, wall)

    def not_started(self, key: AskKey, now: float) -> None:
        """The node answered that it started nothing, or did not answer."""
        self._sooner(key, now + NOT_STARTED_AGAIN_S)

    def heard(self, records: Sequence[ServingRecord], now: float) -> None:
        """Loads the records say failed or were refused after they were asked."""
        for r in records:
            if r.state in REFUSING:
                key = (r.job_id, r.node, "place")
                if key in self.asked and r.updated_at > self.asked[key][1]:
                    self._sooner(key, now + REFUSED_AGAIN_S)

    def pending(self, what: str, now: float) -> set[tuple[str, str]]:
        """(job, node) pairs asked `what` whose time has not come; forgets the rest."""
        self.asked = {k: v for k, v in self.asked.items() if now < v[0]}
        return {(job, node) for job, node, kind in self.asked if kind == what}

    def _sooner(self, key: AskKey, at: float) -> None:
        if key in self.asked:
            again_at, wall = self.asked[key]
            self.asked[key] = (min(again_at, at), wall)
