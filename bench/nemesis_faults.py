"""The nemesis proper: faults picked by a seeded random.Random, done to the
fleet and undone, each written to the history as it starts and ends.

Two lanes run at once (so faults combine: a member killed while an agent is
paused), each with its own Random(f"{seed}/{lane}"), so the schedule of
choices is the seed's; the timing around it is the machine's. A target is
in one fault at a time; the NATS members count as one target (two members
down is a lost quorum, not a fault the fleet is meant to ride out), and an
agent and its link as one. Every fault is undone in a `finally`, and
`heal()` puts back whatever an undo could not.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import IO, Any

from bench.nemesis_check import SERVED_BOUND_S
from bench.nemesis_stack import (
    Fleet,
    degrade,
    pause_member,
    restart_process,
    signal_process,
    undegrade,
)
from tests import disks

from lorafleet_services.stack import ServiceProcess

#: Lanes of faults running at once.
LANES = 2
#: Seconds between one fault's end and a lane's next (a uniform pick).
GAP_S = (1.0, 5.0)
#: Seconds a fault holds (a uniform pick); pauses reach past the node timeout.
HOLD_S = {
    "process.sigkill": (0.5, 3.0),
    "process.sigterm": (0.5, 3.0),
    "process.pause": (0.5, 6.0),
    "nats.kill": (1.0, 5.0),
    "nats.restart": (0.0, 0.0),
    "nats.isolate": (2.0, 6.0),
    "nats.pause": (0.5, 4.0),
    "postgres.restart": (0.5, 3.0),
    "postgres.disk_full": (2.0, 8.0),
    "link.cut": (1.0, 6.0),
    "link.degrade": (3.0, 8.0),
    "disk.full": (2.0, 8.0),
    "disk.slow": (2.0, 8.0),
    "engine.kill": (0.5, 5.0),
    "engine.restart": (0.0, 0.0),
    "engine.slow": (3.0, 10.0),
    "engine.refuse_loads": (3.0, 10.0),
    "gateway.kill_mid_upload": (0.5, 3.0),
    "gateway.kill_mid_stream": (0.5, 3.0),
    "clock.step": (5.0, 30.0),
}
#: Seconds a node's wall clock is stepped by (a uniform pick), forward or
#: back, until the step that puts it back in time (an NTP correction).
CLOCK_STEP_S = (5.0, 120.0)
#: Seconds a slow engine takes more for each completion and load (a uniform pick).
ENGINE_SLOW_S = (1.0, 3.0)
#: Seconds each write and fsync of a slow disk takes more (a uniform pick): a
#: disk whose queue is full behind a stalled flush.
DISK_STALL_S = (0.02, 0.3)
#: Seconds after an engine's refusals end that the run still waits at its end
#: for a placed adapter: the placement asks a pair again 30 s after it was
#: last asked (scheduler/replica_rounds.py), then the load.
REFUSED_RETRY_S = 45.0
#: Seconds a mid-request kill waits for a request of its kind on its replica
#: (none by then: it kills the replica anyway, and says so).
MID_REQUEST_WAIT_S = 20.0
#: Seconds one fault (its do, hold and undo) may take before it is given up.
FAULT_TIMEOUT_S = 90.0


class History:
    """The run's JSON-lines file: every fault and observation, with the
    monotonic and wall times it was written at."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file: IO[str] = path.open("w")
        self.counts: dict[str, int] = {}

    def write(self, kind: str, **fields: Any) -> None:
        entry = {"kind": kind, "mono": time.monotonic(), "wall": time.time(), **fields}
        self._file.write(json.dumps(entry, default=str) + "\n")
        self._file.flush()
        self.counts[kind] = self.counts.get(kind, 0) + 1

    def mono_of_wall(self, wall: float) -> float:
        """A wall time (a log line's) on the monotonic clock of this run."""
        return time.monotonic() - (time.time() - wall)

    def close(self) -> None:
        self._file.close()


class Nemesis:
    def __init__(self, fleet: Fleet, history: History, seed: int) -> None:
        self.fleet = fleet
        self.history = history
        self.seed = seed
        self.busy: set[str] = set()
        self.next_id = 0
        #: Faults done, by kind.
        self.done: dict[str, int] = {}
        #: Until when (monotonic) the engines' faults may still show in what
        #: they hold: an engine back gets SERVED_BOUND_S; one that refused loads
        #: REFUSED_RETRY_S (the placement asks a pair again after 30 s).
        self.engines_settle_until = 0.0

    async def run(self, until: float) -> None:
        """Both lanes until the monotonic time `until`."""
        await asyncio.gather(*(self._lane(lane, until) for lane in range(LANES)))

    async def _lane(self, lane: int, until: float) -> None:
        rng = random.Random(f"{self.seed}/{lane}")
        kinds = self.fleet.kinds()
        while time.monotonic() < until:
            await asyncio.sleep(rng.uniform(*GAP_S))
            kind = rng.choice(kinds)
            target = self._pick(kind, rng)
            if target is None or time.monotonic() >= until:
                continue
            try:
                await asyncio.wait_for(self._fault(kind, target, rng), FAULT_TIMEOUT_S)
            except Exception as e:  # the run goes on; heal() puts back what is left
                self.history.write("fault.error", fault=kind, target=target, error=repr(e))

    def _pick(self, kind: str, rng: random.Random) -> str | None:
        """A free target for `kind` (None: every one is in a fault now)."""
        if kind.startswith("process."):
            options = sorted(self.fleet.services())
        elif kind.startswith("nats.") or kind == "disk.full":
            options = list(self.fleet.cluster.names)
        elif kind == "disk.slow":
            options = sorted(self.fleet.slow_disks)
        elif kind.startswith("link."):
            options = [f"link {n}" for n in self.fleet.links if n != "hub"]
        elif kind.startswith("engine."):
            options = [f"engine {n}" for n in self.fleet.engines]
        elif kind.startswith("gateway."):
            options = list(self.fleet.gateways)
        elif kind == "clock.step":
            options = [f"clock {n}" for n in self.fleet.clocks]
        else:
            options = ["postgres"]
        free = [t for t in options if not self._tokens(t) & self.busy]
        return rng.choice(free) if free else None

    @staticmethod
    def _tokens(target: str) -> set[str]:
        if target.startswith("nats-"):
            return {"nats"}
        if target.startswith(("agent ", "link ", "engine ", "clock ")):
            return {target.split(" ", 1)[1]}
        return {target}

    def _node(self, target: str) -> str | None:
        if target.startswith(("agent ", "link ")):
            return target.split(" ", 1)[1]
        return None

    async def _fault(self, kind: str, target: str, rng: random.Random) -> None:
        hold_s = rng.uniform(*HOLD_S[kind])
        do, undo = self._actions(kind, target)
        tokens = self._tokens(target)
        self.busy |= tokens
        self.next_id += 1
        fid = self.next_id
        engine = target.split(" ", 1)[1] if target.startswith("engine ") else None
        self.history.write("fault.start", id=fid, fault=kind, target=target,
                           node=self._node(target), engine=engine,
                           hold_s=round(hold_s, 2))  # fmt: skip
        self.done[kind] = self.done.get(kind, 0) + 1
        try:
            try:
                await do()
                await asyncio.sleep(hold_s)
            finally:
                await undo()
        finally:
            self.busy -= tokens
            self.history.write("fault.end", id=fid)
            if kind.startswith("engine."):
                wait_s = REFUSED_RETRY_S if kind == "engine.refuse_loads" else SERVED_BOUND_S
                self.engines_settle_until = max(self.engines_settle_until,
                                                time.monotonic() + wait_s)  # fmt: skip

    def _actions(
        self, kind: str, target: str
    ) -> tuple[Callable[[], Awaitable[None]], Callable[[], Awaitable[None]]]:
        """What `kind` does to `target`, and what undoes it."""
        if kind.startswith("process."):
            return self._process_actions(kind, self.fleet.services()[target], target)
        if kind.startswith("engine."):
            return self._engine_actions(kind, target.split(" ", 1)[1])
        if kind.startswith("gateway."):
            return self._gateway_actions(kind, target)
        if kind == "clock.step":
            return self._clock_actions(target.split(" ", 1)[1])
        cluster = self.fleet.cluster
        if kind == "nats.kill":
            return (lambda: cluster.kill(target)), (lambda: self._member_back(target))
        if kind == "nats.restart":
            return (lambda: cluster.restart(target)), _nothing
        if kind == "nats.isolate":
            return (lambda: cluster.isolate(target)), (lambda: cluster.rejoin(target))
        if kind == "nats.pause":
            return _now(pause_member, cluster, target, signal.SIGSTOP), (
                lambda: self._member_continued(target)
            )
        if kind == "disk.full":
            disk = self.fleet.object_disks[target]
            return (lambda: asyncio.to_thread(disks.fill, disk)), (lambda: self._disk_back(target))
        if kind == "disk.slow":
            slow = self.fleet.slow_disks[target]
            stall_s = round(random.Random(f"{self.seed}/{self.next_id}").uniform(*DISK_STALL_S), 3)
            return _now(slow.stall, stall_s), _now(slow.clear)
        if kind.startswith("postgres."):
            pg = self.fleet.pg
            assert pg is not None
            if kind == "postgres.disk_full":
                return (lambda: asyncio.to_thread(pg.fill_disk)), (
                    lambda: asyncio.to_thread(pg.disk_back)
                )
            return (lambda: asyncio.to_thread(pg.stop_now)), (
                lambda: asyncio.to_thread(pg.start_again)
            )
        link = self.fleet.links[target.split(" ", 1)[1]]
        if kind == "link.cut":
            return _now(link.cut), (lambda: asyncio.to_thread(self.fleet.restore_link, link))
        return _now(degrade, link), _now(undegrade, link)

    def _process_actions(
        self, kind: str, proc: ServiceProcess, target: str
    ) -> tuple[Callable[[], Awaitable[None]], Callable[[], Awaitable[None]]]:
        if kind == "process.pause":
            return _now(signal_process, proc, signal.SIGSTOP), _now(
                signal_process, proc, signal.SIGCONT
            )
        sig = signal.SIGKILL if kind == "process.sigkill" else signal.SIGTERM

        async def back() -> None:
            if target == "artifact-store":
                self.history.write("store.started")  # it sweeps at start
            await restart_process(proc)

        return _now(signal_process, proc, sig), back

    def _engine_actions(
        self, kind: str, node: str
    ) -> tuple[Callable[[], Awaitable[None]], Callable[[], Awaitable[None]]]:
        engine = self.fleet.engines[node]
        if kind == "engine.kill":
            return _now(signal_process, engine, signal.SIGKILL), (lambda: restart_process(engine))
        if kind == "engine.restart":
            return (lambda: restart_process(engine)), _nothing
        if kind == "engine.slow":
            delay_s = round(random.Random(f"{self.seed}/{self.next_id}").uniform(*ENGINE_SLOW_S), 2)
            return _now(lambda: engine.set_control(delay_s=delay_s)), _now(engine.set_control)
        return _now(lambda: engine.set_control(refuse_loads=True)), _now(engine.set_control)

    def _gateway_actions(
        self, kind: str, name: str
    ) -> tuple[Callable[[], Awaitable[None]], Callable[[], Awaitable[None]]]:
        """SIGKILL of a gateway replica once a request of the kind is in flight on it."""
        proc = self.fleet.gateways[name]
        what = "upload" if kind.endswith("upload") else "stream"
        fid = self.next_id + 1  # the id _fault gives it, right after this call

        async def kill() -> None:
            until = time.monotonic() + MID_REQUEST_WAIT_S
            key = f"{name} {what}"
            while self.fleet.in_flight.get(key, 0) == 0 and time.monotonic() < until:  # noqa: ASYNC110 (a count the run keeps)
                await asyncio.sleep(0.05)
            self.history.write("fault.mid", id=fid, what=what,
                               in_flight=self.fleet.in_flight.get(key, 0))  # fmt: skip
            signal_process(proc, signal.SIGKILL)

        return kill, (lambda: restart_process(proc))

    def _clock_actions(
        self, node: str
    ) -> tuple[Callable[[], Awaitable[None]], Callable[[], Awaitable[None]]]:
        """The node's clock stepped forward or back, then back in time. Not a
        fault of the node's agent (`node` stays None in the history): a node
        judged lost for a step of its clock is a false loss."""
        rng = random.Random(f"{self.seed}/{self.next_id}")
        offset_s = round(rng.choice((-1, 1)) * rng.uniform(*CLOCK_STEP_S), 1)
        return _now(self._set_clock, node, offset_s), _now(self._set_clock, node, 0.0)

    def _set_clock(self, node: str, offset_s: float) -> None:
        self.history.write("clock.offset", node=node, offset_s=offset_s)
        self.fleet.clocks[node].set(offset_s)

    async def _member_back(self, name: str) -> None:
        await self.fleet.cluster.servers[name].start()
        await self.fleet.cluster.wait_ready()

    async def _disk_back(self, name: str) -> None:
        """The space back, and the member restarted: its halted stream stays
        halted until then (tests/disks.py)."""
        if disks.unfill(self.fleet.object_disks[name]):
            await self.fleet.cluster.restart(name, kill=False)

    async def _member_continued(self, name: str) -> None:
        pause_member(self.fleet.cluster, name, signal.SIGCONT)
        await self.fleet.cluster.wait_ready()

    async def heal(self) -> None:
        """Put back whatever a fault's undo left: every member running, routed and
        continued, PostgreSQL up, links whole, every service running."""
        cluster = self.fleet.cluster
        for slow in self.fleet.slow_disks.values():
            slow.clear()
        for node, clock in self.fleet.clocks.items():
            if clock.offset_s:
                self._set_clock(node, 0.0)
        for name in self.fleet.object_disks:
            with contextlib.suppress(Exception):
                await self._disk_back(name)
        for name in cluster.names:
            with contextlib.suppress(Exception):
                if cluster.servers[name].proc is None:
                    await cluster.servers[name].start()
                pause_member(cluster, name, signal.SIGCONT)
        for name in list(cluster.isolated):
            with contextlib.suppress(Exception):
                await cluster.rejoin(name)
        with contextlib.suppress(Exception):
            await cluster.wait_ready()
        if self.fleet.pg is not None:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.fleet.pg.disk_back)  # started again if down
        for node, link in self.fleet.links.items():
            if node != "hub":
                undegrade(link)
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(self.fleet.restore_link, link)
        for node, engine in self.fleet.engines.items():
            engine.set_control()
            if not engine.running:
                self.history.write("heal", target=f"engine {node}")
                with contextlib.suppress(Exception):
                    await restart_process(engine)
        for target, proc in self.fleet.services().items():
            signal_process(proc, signal.SIGCONT)
            if not proc.running:
                self.history.write("heal", target=target)
                with contextlib.suppress(Exception):
                    await restart_process(proc)


async def _nothing() -> None:
    return None


def _now(fn: Callable[..., object], *args: object) -> Callable[[], Awaitable[None]]:
    """`fn(*args)` as an awaitable action (the signals and `ip` calls are quick)."""

    async def act() -> None:
        fn(*args)

    return act
