"""Training that serving does not feel: the trainer yields to the engines.

While a job with `yield_to_serving: auto` trains, `Yielder` reads every
engine's load (agent/node/engine_load.py) and `decide` says whether the
trainer should be paused. An engine whose process the agent sees is read
from /proc every `yield_cpu_sample_s` (10 ms: it costs the engine nothing),
and through its /metrics only while the trainer is paused for it, to hold
the pause through a stretch its server is quiet in (a long prefill on a
card); an engine the agent does not see, through its /metrics (or
llama.cpp's /slots) every `yield_sample_s`:

- an engine whose server's main thread ran `busy_cpu_share` of a core
  since the last read, one with `busy_requests` requests running or waiting, too busy
  to answer its load read in time (`EngineLoad.late`) or, with
  `busy_requests` 1, one that processed tokens since the last read
  (`EngineLoad.worked`): pause;
- paused, every engine idle for `idle_s`: go on;
- paused for `period_s x (1 - run_share)` under load that never left
  `idle_s` of quiet: run for `period_s x run_share` whatever the load (the
  duty cycle: training still progresses under a moderate, steady stream).

The pause is a file in the job directory (PAUSE_FILE, its text the reason)
that the trainer looks at between two optimizer steps
(lorafleet_trainer.protocol.PauseGate), so a pause takes hold within a
step. The agent touches it while it holds the pause: a file the agent
stopped touching is stale to the trainer (PAUSE_LEASE_S) and no pause
outlives its agent. No timeout or stall check of the agent's or the
scheduler's counts training progress (the node's heartbeat and fence do
not depend on the trainer), so a paused trainer trips none; its
checkpoints are written after steps, so none is due while it waits.
`YieldNotes` turns the trainer's "yield" lines into progress messages, at
most one per YIELD_NOTE_S, and `lorafleet_trainer_yield_seconds{cause}`
counts the seconds paused: `engine_busy` while an engine has requests,
`idle_wait` while it has been idle less than idle_s.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx2

from lorafleet import metrics
from lorafleet._tasks import stop_tasks
from lorafleet.log import Event
from lorafleet_schemas.messages import YIELDING_TO_SERVING, TrainerYield
from lorafleet_services.agent.config import AgentConfig
from lorafleet_services.agent.node.engine_load import (
    EngineLoad,
    LoadSource,
    LoadTarget,
    cpu_load,
    main_thread_cpu_ns,
    read_load,
)

#: In the job directory: the trainer pauses while it exists.
PAUSE_FILE = "pause"
#: Seconds between two progress messages about yielding.
YIELD_NOTE_S = 10.0


@dataclass(frozen=True, slots=True)
class YieldThresholds:
    """The node's thresholds (AgentConfig.yield_*, which says what each means)."""

    sample_s: float = 0.1
    busy_requests: int = 1
    idle_s: float = 0.15
    run_share: float = 0.25
    period_s: float = 4.0
    cpu_sample_s: float = 0.01
    busy_cpu_share: float = 0.1

    @classmethod
    def of(cls, cfg: AgentConfig) -> YieldThresholds:
        return cls(
            cfg.yield_sample_s,
            cfg.yield_busy_requests,
            cfg.yield_idle_s,
            cfg.yield_run_share,
            cfg.yield_period_s,
            cfg.yield_cpu_sample_s,
            cfg.yield_busy_cpu_share,
        )


@dataclass(frozen=True, slots=True)
class YieldState:
    """Whether the trainer should be paused, since when (`since`: the last
    change), when an engine was last seen busy, until when a duty-cycle run
    goes on regardless, and why, in words."""

    paused: bool = False
    since: float = 0.0
    last_busy: float = -math.inf
    run_until: float = -math.inf
    reason: str = ""


def busiest(loads: Sequence[EngineLoad]) -> EngineLoad | None:
    """The engine that says most about the pause: one too busy to answer
    first, then the one with most requests, then one that worked, then the
    one whose server worked most."""
    return max(
        loads, key=lambda x: (x.late, x.requests, x.worked, x.cpu_share or 0.0), default=None
    )


def is_busy(loads: Sequence[EngineLoad], th: YieldThresholds) -> bool:
    def busy(x: EngineLoad) -> bool:
        return (
            x.late
            or x.requests >= th.busy_requests
            or (x.worked and th.busy_requests <= 1)
            or (x.cpu_share is not None and x.cpu_share >= th.busy_cpu_share)
        )

    return any(busy(x) for x in loads)


def decide(
    state: YieldState, loads: Sequence[EngineLoad], now: float, th: YieldThresholds
) -> YieldState:
    """The state after one read of the engines' `loads` at `now` (engines that
    did not answer are left out: an engine that is down has no users)."""
    busy = is_busy(loads, th)
    last_busy = now if busy else state.last_busy
    top = busiest(loads)
    said = top.describe() if busy and top is not None else state.reason
    if not state.paused:
        if busy and now >= state.run_until:
            return YieldState(True, now, last_busy, reason=said)
        return replace(state, last_busy=last_busy)
    if now - last_busy >= th.idle_s:
        return YieldState(False, now, last_busy, reason=f"the engines idle for {th.idle_s:g} s")
    if th.run_share > 0 and now - state.since >= th.period_s * (1 - th.run_share):
        run_s = th.period_s * th.run_share
        return YieldState(
            False, now, last_busy, now + run_s, f"a {run_s:g} s turn of the duty cycle"
        )
    return replace(state, last_busy=last_busy, reason=said)


def pause_cause(state: YieldState, now: float) -> str:
    """What a paused second is counted under (metrics.YIELD_CAUSES)."""
    return "engine_busy" if state.last_busy >= now else "idle_wait"


def load_targets(
    vllm: Sequence[tuple[str, str | None, int | None]], llamacpp: Sequence[str]
) -> list[LoadTarget]:
    """The engines to read: the vLLM servers the engine watch knows (URL, API
    key and process, when the scan found it) and the configured
    llama-servers (`URL` or `URL|slots`)."""
    out = [LoadTarget(url, LoadSource.VLLM_METRICS, key, pid) for url, key, pid in vllm]
    for entry in llamacpp:
        url, _, how = entry.partition("|")
        source = LoadSource.LLAMACPP_SLOTS if how == "slots" else LoadSource.LLAMACPP_METRICS
        out.append(LoadTarget(url.rstrip("/"), source))
    return out


class PauseFile:
    """The agent's side of the pause file: `hold(reason)` writes it (to a
    temporary name, then renamed: the trainer never reads half of it),
    `touch()` renews it, `release()` removes it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def hold(self, reason: str) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(reason + "\n", encoding="utf-8")
        os.replace(tmp, self.path)

    def touch(self) -> None:
        with contextlib.suppress(OSError):
            os.utime(self.path)

    def release(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


class Yielder:
    """Reads the engines and holds or releases the pause file, until cancelled
    (the pause is released then)."""

    def __init__(
        self,
        pause: PauseFile,
        targets: Callable[[], Sequence[LoadTarget]],
        th: YieldThresholds,
        logger: Any,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pause = pause
        self.targets = targets
        self.th = th
        self.logger = logger
        self.clock = clock
        self.state = YieldState()
        self.sampled_at = clock()
        #: engine -> its token count at the previous read (`EngineLoad.worked`).
        self.tokens: dict[str, float] = {}
        #: engine process -> its main thread's run time at the previous read, and when.
        self.cpu: dict[int, tuple[int, float]] = {}
        #: When the engines' /metrics were last read.
        self.metrics_at = -math.inf
        #: When the pause file was last written (the hold latency's start).
        self.held_at: float | None = None

    async def run(self) -> None:
        async with httpx2.AsyncClient() as http:
            try:
                while True:
                    try:
                        await self.sample(http)
                    except Exception as e:  # a bug here must not stop the job
                        self.logger.warning(Event.JOB_YIELD, error=repr(e))
                    await asyncio.sleep(self.th.cpu_sample_s if self.cpu else self.th.sample_s)
            finally:
                self.pause.release()

    async def sample(self, http: httpx2.AsyncClient) -> None:
        """One read of the engines, and what it changes."""
        targets = self.targets()
        now = self.clock()
        seen = {t.pid for t in targets}
        self.cpu = {pid: v for pid, v in self.cpu.items() if pid in seen}
        loads = [x for t in targets if t.pid is not None and (x := self._cpu(t, now)) is not None]
        due = now - self.metrics_at >= self.th.sample_s
        # A tick that reads nothing leaves metrics_at be: a pause just held
        # reads /metrics at its next tick, not up to sample_s later.
        read = [t for t in targets if t.pid not in self.cpu or self.state.paused] if due else []
        if read:
            self.metrics_at = now
            found = await asyncio.gather(*(read_load(http, t) for t in read))
            loads += [self._worked(x) for x in found if x is not None]
            for t in read:  # the read's own cost to the server is no one's request
                if t.pid in self.cpu and (ns := main_thread_cpu_ns(t.pid)) is not None:
                    self.cpu[t.pid] = (ns, self.clock())
            now = self.clock()
        before, self.state = self.state, decide(self.state, loads, now, self.th)
        if before.paused:
            cause = pause_cause(self.state, now)
            metrics.TRAINER_YIELD.labels(cause).inc(max(0.0, now - self.sampled_at))
        self.sampled_at = now
        self._apply(before, now)

    def _cpu(self, target: LoadTarget, now: float) -> EngineLoad | None:
        """`target`'s load from /proc (None at its first read, or where /proc
        does not show its run time: it is then read through /metrics)."""
        pid = target.pid
        if pid is None:
            return None
        before = self.cpu.pop(pid, None)
        ns = main_thread_cpu_ns(pid)
        if ns is None:
            return None
        self.cpu[pid] = (ns, now)
        if before is None or ns < before[0]:
            return None
        return cpu_load(target, ns - before[0], now - before[1])

    def _worked(self, load: EngineLoad) -> EngineLoad:
        """`load`, `worked` when its token count grew since the last read (a
        count that fell is an engine restarted: a new start, not work)."""
        if load.tokens is None:
            return load
        before = self.tokens.get(load.engine)
        self.tokens[load.engine] = load.tokens
        return replace(load, worked=before is not None and load.tokens > before)

    def _apply(self, before: YieldState, now: float) -> None:
        state = self.state
        if state.paused and not before.paused:
            self.pause.hold(state.reason)
            self.held_at = now
            self.logger.info(Event.JOB_YIELD, paused=True, reason=state.reason)
        elif before.paused and not state.paused:
            self.pause.release()
            self.logger.info(Event.JOB_YIELD, paused=False, reason=state.reason,
                             paused_s=round(now - before.since, 3))  # fmt: skip
        elif state.paused:
            self.pause.touch()


#: The engines whose load a job that yields to serving reads, as they are now.
LoadTargets = Callable[[], Sequence[LoadTarget]]


def start_yielding(
    pause_path: Path, mode: str, engines: LoadTargets | None, cfg: AgentConfig, logger: Any
) -> asyncio.Task[None] | None:
    """A Yielder for a job whose yield_to_serving is `mode`, in a task of its
    own; None for "off" (or nothing to read)."""
    if mode != "auto" or engines is None:
        return None
    yielder = Yielder(PauseFile(pause_path), engines, YieldThresholds.of(cfg), logger)
    return asyncio.create_task(yielder.run(), name=f"yield-{pause_path.parent.name}")


async def stop_yielding(task: asyncio.Task[None] | None) -> None:
    """Cancel start_yielding's task and wait: the pause file is gone after."""
    await stop_tasks(task)


class YieldNotes:
    """The trainer's "yield" lines as progress messages. A pause is noted
    (why, and the pauses not noted since the last note) when the last note
    is YIELD_NOTE_S old, and the end of a noted pause too: a bursty stream
    pauses the trainer every few seconds, and the job's message stays
    "yielding to serving" only while it does."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.noted_at = -math.inf
        self.showing = False
        self.pauses = 0
        self.paused_s = 0.0

    def message(self, line: TrainerYield) -> str | None:
        now = self.clock()
        if line.state == "resumed":
            self.pauses += 1
            self.paused_s += line.paused_s
            if not self.showing:
                return None
            self.showing = False
            return f"training again after {line.paused_s:.1f} s {YIELDING_TO_SERVING}"
        if now - self.noted_at < YIELD_NOTE_S:
            return None
        since = (
            f" ({self.pauses} pauses, {self.paused_s:.1f} s in all, since the last note)"
            if self.pauses
            else ""
        )
        self.noted_at, self.showing, self.pauses, self.paused_s = now, True, 0, 0.0
        return f"{YIELDING_TO_SERVING} after step {line.step}: {line.cause}{since}"
