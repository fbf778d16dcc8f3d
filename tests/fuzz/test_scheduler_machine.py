"""The scheduler's pure rules (scheduler/node_table, placement, reconcile) as a state machine.

Hypothesis submits, dispatches, cancels and resumes jobs, starts, kills and
restarts agents, lets time pass (live agents beat every heartbeat), sweeps,
expires and reconciles, in any order. The machine plays the recorder (jobs
by id, moved as the control plane moves them) and the agents (each runs at
most one job, as its beats say), and checks after every step:

- no job is lost: every submitted job is there, in one state, and a job on
  a node names one;
- an agent is never sent a job while it runs one, and a dispatch round
  sends at most one job per node, to a live node, a named job to its node;
- a node whose agent beats is never judged lost, and a job its beats name
  is never failed by reconcile;
- a lost job is requeued while it has attempts left, else failed;
- once the dead agents have been silent past the timeout and reconcile's
  grace, no job is still held on their nodes (`settle`);
- nodes are cordoned, drained (with their training moved, forced or not)
  and opened again at any time: nothing new is sent to a node not open; a
  job moved off a drained node is requeued with one more attempt allowed
  and its node stops it; a job that stays says why (`why_training_stays`).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field

import msgspec
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lorafleet.states import FINAL, ON_NODE, can_requeue, loss_outcome
from lorafleet_schemas.messages import Card, Heartbeat, JobRecord, JobState, NodeSchedule
from lorafleet_services.scheduler import node_table, placement, reconcile
from lorafleet_services.scheduler.node_table import NodeTable
from tests.records import job_record

T0 = dt.datetime(2026, 12, 1, tzinfo=dt.UTC)
#: The settings the machine runs with, as the system tests' (seconds).
HEARTBEAT_S = 0.5
TIMEOUT_S = 3.0
#: Node name -> its cards [(total_mib, free_mib)]; "cpu" trains on its CPU.
NODES: dict[str, list[tuple[int, int]]] = {
    "big": [(80_000, 80_000)],
    "small": [(24_000, 20_000), (24_000, 24_000)],
    "cpu": [],
}


@dataclass
class Agent:
    started_at: dt.datetime
    running: str | None = None
    #: A start sent and not yet taken: the agent takes it after its next beat
    #: (a beat already on its way names no job), as a real one does.
    pending: str | None = None
    beating: bool = True

    def holds(self, job_id: str) -> bool:
        return job_id in (self.running, self.pending)


@dataclass
class World:
    """What the recorder and the agents hold, and the scheduler's own notes."""

    now: float = 1000.0
    table: NodeTable = field(default_factory=NodeTable)
    jobs: dict[str, JobRecord] = field(default_factory=dict)
    #: job -> the node its submitter named (where a requeue or resume sends it back).
    requested: dict[str, str | None] = field(default_factory=dict)
    agents: dict[str, Agent] = field(default_factory=dict)
    first_seen: dict[str, float] = field(default_factory=dict)
    sent_here: set[str] = field(default_factory=set)

    def wall(self) -> dt.datetime:
        return T0 + dt.timedelta(seconds=self.now)

    def on_node(self) -> list[JobRecord]:
        return [j for j in self.jobs.values() if j.state in ON_NODE]

    def set(self, job: JobRecord, **changes: object) -> JobRecord:
        changed = msgspec.structs.replace(job, updated_at=self.wall(), **changes)
        self.jobs[job.id] = changed
        return changed

    def beat(self, name: str) -> None:
        agent = self.agents[name]
        self.table.beat(
            Heartbeat(
                node=name,
                version="machine",
                started_at=agent.started_at,
                time=self.wall(),
                cards=[
                    Card(index=i, name="card", total_mib=total, free_mib=free)
                    for i, (total, free) in enumerate(NODES[name])
                ],
                job=agent.running,
                cpu_training=not NODES[name],
                heartbeat_s=HEARTBEAT_S,
                ttl_s=int(TIMEOUT_S),
            ),
            self.now,
        )

    def lose(self, job: JobRecord, message: str, cause: str) -> None:
        """What RecorderClient.lose_job does, checked against the rule."""
        current = self.jobs[job.id]
        if current.state not in ON_NODE:
            return  # moved on first (the compare-and-set would miss)
        state, _ = loss_outcome(current, cause, message)
        requeue = can_requeue(current.state, current.attempt, current.max_attempts)
        assert (state is JobState.QUEUED) == requeue, (current, state)
        if state is JobState.QUEUED:
            self.set(current, state=state, node=self.requested[job.id])
        else:
            self.set(current, state=state)
        self.first_seen.pop(job.id, None)


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.w = World()

    # --- the recorder's side ---------------------------------------------

    @rule(
        node=st.none() | st.sampled_from(sorted(NODES)),
        mib=st.sampled_from([1_000, 20_000, 24_000, 80_000, 100_000]),
        attempts=st.integers(1, 3),
    )
    def submit(self, node: str | None, mib: int, attempts: int) -> None:
        job_id = f"j{len(self.w.jobs) + 1}"
        self.w.jobs[job_id] = job_record(
            id=job_id, node=node, requested_node=node, gpu_memory_mib=mib,
            max_attempts=attempts, attempt=0, created_at=self.w.wall(), updated_at=self.w.wall(),
        )  # fmt: skip
        self.w.requested[job_id] = node

    @precondition(lambda self: any(j.state not in FINAL for j in self.w.jobs.values()))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        ids = sorted(i for i, j in self.w.jobs.items() if j.state not in FINAL)
        job = self.w.jobs[data.draw(st.sampled_from(ids))]
        self.w.set(job, state=JobState.CANCELLED)
        for agent in self.w.agents.values():
            if agent.running == job.id:
                agent.running = None  # the cancel reached it
            if agent.pending == job.id:
                agent.pending = None

    @precondition(
        lambda self: any(j.state in FINAL - {JobState.DONE} for j in self.w.jobs.values())
    )
    @rule(data=st.data(), more=st.integers(1, 2))
    def resume(self, data: st.DataObject, more: int) -> None:
        ids = sorted(
            i for i, j in self.w.jobs.items() if j.state in (JobState.FAILED, JobState.CANCELLED)
        )
        job = self.w.jobs[data.draw(st.sampled_from(ids))]
        self.w.set(
            job,
            state=JobState.QUEUED,
            node=self.w.requested[job.id],
            max_attempts=job.attempt + more,
        )

    # --- the agents -------------------------------------------------------

    @rule(name=st.sampled_from(sorted(NODES)))
    def start_agent(self, name: str) -> None:
        """An agent process starts (again): a new started_at, running nothing."""
        self.w.agents[name] = Agent(started_at=self.w.wall())
        self.w.beat(name)

    @precondition(lambda self: any(a.beating for a in self.w.agents.values()))
    @rule(data=st.data())
    def kill_agent(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(n for n, a in self.w.agents.items() if a.beating)))
        self.w.agents[name] = Agent(started_at=self.w.agents[name].started_at, beating=False)

    @precondition(lambda self: any(a.running for a in self.w.agents.values()))
    @rule(data=st.data(), delivered=st.booleans())
    def job_progresses(self, data: st.DataObject, delivered: bool) -> None:
        """An agent's job moves on: running, uploading (delivered: the agent
        lets go, the artifact-store finishes it later), or done."""
        name = data.draw(st.sampled_from(sorted(n for n, a in self.w.agents.items() if a.running)))
        agent = self.w.agents[name]
        job = self.w.jobs[str(agent.running)]
        if job.state is JobState.STARTING:
            self.w.set(job, state=JobState.RUNNING)
        elif delivered:
            self.w.set(job, state=JobState.UPLOADING)
            agent.running = None
        else:
            self.w.set(job, state=JobState.DONE)
            agent.running = None

    @precondition(
        lambda self: any(
            j.state is JobState.UPLOADING and j.id not in self._held() for j in self.w.jobs.values()
        )
    )
    @rule(data=st.data())
    def artifacts_stored(self, data: st.DataObject) -> None:
        held = self._held()
        ids = sorted(
            i for i, j in self.w.jobs.items() if j.state is JobState.UPLOADING and i not in held
        )
        self.w.set(self.w.jobs[data.draw(st.sampled_from(ids))], state=JobState.DONE)

    def _held(self) -> set[str]:
        return {a.running for a in self.w.agents.values() if a.running}

    # --- the operator's marks --------------------------------------------

    @rule(
        name=st.sampled_from(sorted(NODES)),
        schedule=st.sampled_from(list(NodeSchedule)),
        move=st.booleans(),
        force=st.booleans(),
    )
    def mark(self, name: str, schedule: NodeSchedule, move: bool, force: bool) -> None:
        """`lorafleet nodes cordon|drain|uncordon`, as node_marks.check_request allows."""
        move = move and schedule is NodeSchedule.DRAINED
        self.w.table.mark(name, schedule, move_training=move, force=force and move)

    @rule()
    def move_training(self) -> None:
        """The leader's round moving a drained node's training (once its
        checkpoint is there: move_checkpoints.py), as RecorderClient.move_job does."""
        w = self.w
        for job in reconcile.training_moves(w.on_node(), w.table.nodes, w.table.moves):
            node = str(job.node)
            assert w.table.nodes[node].schedule is NodeSchedule.DRAINED and node in w.table.moves
            assert reconcile.why_training_stays(job, w.table.moves[node]) is None, job
            assert w.requested[job.id] != node, f"{job.id} was submitted for {node}: it stays"
            w.set(job, state=JobState.QUEUED, node=w.requested[job.id],
                  max_attempts=job.max_attempts + 1)  # fmt: skip
            w.first_seen.pop(job.id, None)
            agent = w.agents[node]
            if agent.holds(job.id):  # told to stop it; held from dispatch until it did
                agent.running = agent.pending = None

    # --- time and the scheduler ------------------------------------------

    @rule(beats=st.integers(1, 8))
    def time_passes(self, beats: int) -> None:
        """`beats` heartbeat periods; every live agent beats in each."""
        for _ in range(beats):
            self.w.now += HEARTBEAT_S
            for name, agent in sorted(self.w.agents.items()):
                if agent.beating:
                    self.w.beat(name)
                    self._take_start(name, agent)

    def _take_start(self, name: str, agent: Agent) -> None:
        if agent.pending is None:
            return
        job = self.w.jobs[agent.pending]
        # Reconcile's grace is for this: a start not yet taken is not lost.
        assert job.state is JobState.STARTING and job.node == name, (
            f"{job.id} was taken from {name} before its agent could take its start: {job}"
        )
        agent.running, agent.pending = agent.pending, None

    @rule()
    def dispatch(self) -> None:
        w = self.w
        queued = sorted(
            (j for j in w.jobs.values() if j.state is JobState.QUEUED),
            key=lambda j: (j.created_at, int(j.id[1:])),
        )
        busy = placement.busy_nodes(w.on_node(), w.table.nodes, w.first_seen)
        plan = placement.plan_dispatch(queued, w.table.nodes, busy, w.now)
        nodes = [node for _, node in plan.send]
        assert len(nodes) == len(set(nodes)), plan.send
        for job, node in plan.send:
            assert w.table.nodes[node].alive and node not in busy, (job.id, node)
            assert w.table.nodes[node].schedule is NodeSchedule.OPEN, (job.id, node)
            assert job.node in (None, node), (job.id, node)
            agent = w.agents[node]
            assert agent.running is None and agent.pending is None, (
                f"{job.id} sent to {node}, which runs {agent.running or agent.pending}"
            )
            w.set(
                job,
                state=JobState.STARTING,
                node=node,
                attempt=job.attempt + 1,
                started_at=w.wall(),
            )
            w.first_seen[job.id] = w.now
            w.sent_here.add(job.id)
            if agent.beating:
                agent.pending = job.id

    @rule()
    def sweep(self) -> None:
        lost = self.w.table.sweep(self.w.now, TIMEOUT_S)
        self._nodes_lost(lost)

    @precondition(lambda self: any(not a.beating for a in self.w.agents.values()))
    @rule(data=st.data())
    def beat_expires(self, data: st.DataObject) -> None:
        """The KV marker of a silent node: it comes after the TTL."""
        name = data.draw(
            st.sampled_from(sorted(n for n, a in self.w.agents.items() if not a.beating))
        )
        node = self.w.table.nodes.get(name)
        if node is None or self.w.now - node.last_seen < TIMEOUT_S:
            return
        lost = self.w.table.expire(name)
        self._nodes_lost([lost] if lost is not None else [])

    def _nodes_lost(self, lost: list[node_table.Node]) -> None:
        for node in lost:
            assert not self.w.agents[node.name].beating, f"{node.name} beats but was lost"
            for job in reconcile.jobs_lost_with(node, self.w.on_node(), self.w.first_seen):
                self.w.lose(job, reconcile.node_lost_message(node), reconcile.node_lost_cause(node))
            # Requeued or failed at once, by its attempts (World.lose checks
            # which); only a delivered upload stays on the lost node.
            held = [
                j.id
                for j in self.w.on_node()
                if j.node == node.name
                and not placement.is_delivered(j, node, self.w.first_seen.get(j.id))
            ]
            assert held == [], (node.name, held)

    @rule()
    def reconcile(self) -> None:
        w = self.w
        r = reconcile.reconcile(
            w.on_node(), w.table.nodes, w.now, w.first_seen, sent_here=w.sent_here
        )
        for fail in r.fail:
            node = w.table.nodes.get(str(fail.job.node))
            agent = w.agents.get(str(fail.job.node))
            named = node is not None and node.alive and node.running == fail.job.id
            assert not (agent and agent.beating and agent.running == fail.job.id and named), fail
            w.lose(fail.job, fail.message, fail.cause)
        for resend in r.resend:
            agent = w.agents[resend.node]
            if agent.beating and agent.running is None:
                agent.pending = resend.job.id
        for check in r.check:
            if reconcile.should_cancel_on_node(w.jobs.get(check.job_id), check.node):
                w.agents[check.node].running = None

    @rule()
    def settle(self) -> None:
        """Past the timeout and every grace: no job is held on a node whose agent
        does not run it (a dead agent's, or a restarted one's)."""
        self.time_passes(
            int((TIMEOUT_S + node_table.SWEEP_MARGIN_S + reconcile.RECONCILE_GRACE_S) / HEARTBEAT_S)
            + 2
        )
        self.sweep()
        self.reconcile()
        # A delivered upload stays (the artifact-store finishes it); any
        # other job on a node is one its agent runs.
        stuck = [
            j
            for j in self.w.on_node()
            if j.state is not JobState.UPLOADING and not self.w.agents[str(j.node)].holds(j.id)
        ]
        assert stuck == [], stuck

    # --- what holds after every step -------------------------------------

    @invariant()
    def no_job_is_lost(self) -> None:
        assert sorted(self.w.jobs, key=lambda i: int(i[1:])) == [
            f"j{i}" for i in range(1, len(self.w.jobs) + 1)
        ]
        for job in self.w.jobs.values():
            if job.state in ON_NODE:
                assert job.node is not None, job
            if job.state is JobState.QUEUED:
                assert job.node == self.w.requested[job.id], job
            assert job.attempt <= job.max_attempts, job

    @invariant()
    def an_agent_runs_one_job_the_recorder_holds_there(self) -> None:
        for name, agent in self.w.agents.items():
            assert agent.running is None or agent.pending is None, agent
            if agent.running is not None:
                job = self.w.jobs[agent.running]
                assert job.state in ON_NODE and job.node == name, (name, job)
        running = [a.running or a.pending for a in self.w.agents.values() if a.running or a.pending]
        assert len(running) == len(set(running)), running


TestSchedulerMachine = SchedulerMachine.TestCase
