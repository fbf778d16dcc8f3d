"""Training beside a serving engine: what the engine's users feel, with and
without the trainer yielding to them (agent/training/yielding.py).

    .venv/bin/python bench/colocation.py [--seconds 30] [--rounds 3] [--rate 2]
        [--device cpu|cuda] [--idle-s S] [--url URL --model PATH [--pid PID]]

One real vLLM (the CPU build from the engines cache, serving the tiny Llama
as the tests' server does; `--url`/`--model`: one already running, `--pid`
its server process) and one real trainer (`python -m lorafleet_trainer`,
LoRA on the same tiny Llama, its steps without end) started once and kept
for every phase. A request stream of streamed completions (`--tokens`
each), the same in every window: `--rate` a second, evenly spaced with a
seeded jitter, for the first half ("steady"), then bursts of `--burst` at
once every `--burst-every-s` ("bursts": idle gaps between them). Phases,
`--seconds` each, run as `--rounds` windows in turn (a drift of the machine,
where the kernel put whose threads, falls on every phase alike):

1. trainer alone: no stream; its steps a second (the solo rate);
2. engine alone: the stream, the trainer held paused by the pause file
   (it only looks at the file, every 20 ms);
3. stream + training, yielding off: no pause file, the trainer's threads
   at SCHED_OTHER;
4. stream + training, yielding on, the engine read through its /metrics
   (as an engine the agent does not see): the agent's Yielder, in a
   process of its own as on a node, holds the file with the node's default
   thresholds, and on the CPU the trainer's threads run at SCHED_IDLE, as
   a yielding CPU job's do;
5. the same, the engine's server read from /proc (as the agent reads an
   engine it sees), its /metrics while paused.

Printed: per phase and part, requests, time to first token and the gap
between tokens (p50, p99, ms) as the client sees them, each p99 against the
engine alone; the trainer's steps a second against its share of the solo
rate the engine's idle time allows (the target: at least 0.7 x that); and
how fast a pause takes hold: from the request that made the engine busy
being sent to the trainer's "yield paused" line, with the agent's part (to
the pause file written) apart. On a shared machine every figure is noisy:
compare phases of one run, never runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx2  # noqa: E402
from tests.trainer.harness import ndjson, qa_records, write_job  # noqa: E402

from lorafleet_services.agent.node.engine_load import LoadSource, LoadTarget  # noqa: E402
from lorafleet_services.agent.training.yielding import (  # noqa: E402
    PauseFile,
    Yielder,
    YieldState,
    YieldThresholds,
)

#: Seconds the trainer may take to load and make its first step.
TRAINER_START_TIMEOUT_S = 600.0


@dataclass
class Req:
    part: str
    sent: float
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    end: float = 0.0


async def stream_one(http: httpx2.AsyncClient, url: str, model: str, tokens: int, r: Req) -> None:
    body = {
        "model": model, "prompt": "Hello there, how are", "stream": True,
        "max_tokens": tokens, "ignore_eos": True, "temperature": 0,
    }  # fmt: skip
    last = r.sent
    async with http.stream("POST", f"{url}/v1/completions", json=body) as resp:
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            if r.ttft_s is None:
                r.ttft_s = now - r.sent
            else:
                r.gaps_s.append(now - last)
            last = now
    r.end = time.perf_counter()


def schedule(seconds: float, a: argparse.Namespace) -> list[tuple[float, str]]:
    """(offset s, part) of each request: steady for the first half, then bursts."""
    rng = random.Random(7)
    out, t, half = [], 0.0, seconds / 2
    while t < half:
        out.append((t, "steady"))
        t += (1 / a.rate) * rng.uniform(0.5, 1.5)
    t = half
    while t < seconds:
        out += [(t, "bursts")] * a.burst
        t += a.burst_every_s
    return out


async def run_stream(url: str, model: str, seconds: float, a: argparse.Namespace) -> list[Req]:
    reqs: list[Req] = []
    t0 = time.perf_counter()
    async with httpx2.AsyncClient(timeout=120) as http, asyncio.TaskGroup() as tg:
        for offset, part in schedule(seconds, a):
            await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
            r = Req(part, time.perf_counter())
            reqs.append(r)
            tg.create_task(stream_one(http, url, model, a.tokens, r))
        await asyncio.sleep(max(0.0, t0 + seconds - time.perf_counter()))
    return reqs


class Trainer:
    """The real trainer as a subprocess; its lines stamped as they arrive."""

    def __init__(self, job: Path) -> None:
        self.job = job
        self.lines: list[tuple[float, dict[str, Any]]] = []
        self.proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> None:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
               "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": os.environ.get(
                   "OMP_NUM_THREADS", "1")}  # fmt: skip
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "lorafleet_trainer", str(self.job),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, env=env,
            cwd=self.job.parent,
        )  # fmt: skip
        self._reader = asyncio.create_task(self._read())
        deadline = time.perf_counter() + TRAINER_START_TIMEOUT_S
        while not self.steps(0, time.perf_counter()):
            if self.proc.returncode is not None or time.perf_counter() > deadline:
                raise SystemExit(f"the trainer made no step: {self.lines[-3:]}")
            await asyncio.sleep(0.2)

    def schedule(self, idle: bool) -> None:
        """Every thread of the trainer at SCHED_IDLE (what a yielding CPU job
        runs at: lorafleet_trainer.__main__) or back at SCHED_OTHER (a job
        with yielding off): one trainer serves all four phases."""
        assert self.proc is not None
        policy = os.SCHED_IDLE if idle else os.SCHED_OTHER
        for tid in os.listdir(f"/proc/{self.proc.pid}/task"):
            with contextlib.suppress(ProcessLookupError):
                os.sched_setscheduler(int(tid), policy, os.sched_param(0))

    async def _read(self) -> None:
        if self.proc is None or self.proc.stdout is None:
            return
        async for raw in self.proc.stdout:
            self.lines.append((time.perf_counter(), json.loads(raw)))

    def steps(self, t0: float, t1: float) -> int:
        return sum(1 for t, x in self.lines if x["event"] == "step" and t0 <= t < t1)

    def yields(self, state: str, t0: float, t1: float) -> list[tuple[float, dict[str, Any]]]:
        return [(t, x) for t, x in self.lines
                if x["event"] == "yield" and x["state"] == state and t0 <= t < t1]  # fmt: skip

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.terminate()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.proc.wait(), 10)
            if self.proc.returncode is None:
                self.proc.kill()
                await self.proc.wait()
        if self._reader is not None:
            self._reader.cancel()


class Quiet:
    """A logger that says nothing: the table is the output."""

    def info(self, *args: Any, **kwargs: Any) -> None:
        pass


class TimedYielder(Yielder):
    """The agent's Yielder, printing when it writes the pause file."""

    def _apply(self, before: YieldState, now: float) -> None:
        if self.state.paused and not before.paused:
            print(now, flush=True)  # CLOCK_MONOTONIC: the bench's perf_counter too
        super()._apply(before, now)


def yielder_main(url: str, pid: int | None, pause: Path, idle_s: float | None) -> None:
    """The agent's Yielder in a process of its own, as on a node (in the
    bench's own process it would share the client's event loop and CPU)."""
    th = YieldThresholds() if idle_s is None else YieldThresholds(idle_s=idle_s)
    target = LoadTarget(url, LoadSource.VLLM_METRICS, pid=pid)
    yielder = TimedYielder(PauseFile(pause), lambda: [target], th, Quiet(), time.perf_counter)
    print("ready", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(yielder.run())


class YielderProcess:
    """`yielder_main` as a child process; `holds` once stopped."""

    def __init__(self, a: argparse.Namespace, url: str, pid: int | None, pause: Path) -> None:
        argv = [sys.executable, __file__, "--yielder", url, "--pause", str(pause)]
        argv += ["--pid", str(pid)] if pid else []
        argv += ["--idle-s", str(a.idle_s)] if a.idle_s is not None else []
        self.argv = argv
        self.holds: list[float] = []
        self.proc: asyncio.subprocess.Process | None = None

    async def __aenter__(self) -> YielderProcess:
        self.proc = await asyncio.create_subprocess_exec(*self.argv, stdout=asyncio.subprocess.PIPE)
        assert self.proc.stdout is not None
        await self.proc.stdout.readline()  # "ready": its imports done
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGINT)  # the Yielder lets go of the pause
        out, _ = await self.proc.communicate()
        self.holds = [float(x) for x in out.split()]


@dataclass
class Phase:
    """One phase's windows (one a round), their requests and the trainer's steps."""

    name: str
    windows: list[tuple[float, float]] = field(default_factory=list)
    reqs: list[Req] = field(default_factory=list)
    steps: int = 0
    #: The share of the windows with a request in flight.
    busy_s: float = 0.0
    holds_s: list[float] = field(default_factory=list)
    agent_s: list[float] = field(default_factory=list)
    paused_s: float = 0.0
    #: Requests to an idle engine that were over before the trainer paused.
    unseen: int = 0

    @property
    def seconds(self) -> float:
        return sum(t1 - t0 for t0, t1 in self.windows)

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.seconds

    @property
    def idle_share(self) -> float:
        return 1 - self.busy_s / self.seconds


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def busy_share(reqs: list[Req], t0: float, t1: float) -> float:
    """The share of [t0, t1) with a request in flight (the engine busy)."""
    spans = sorted((max(r.sent, t0), min(r.end or t1, t1)) for r in reqs)
    busy, until = 0.0, t0
    for a, b in spans:
        a = max(a, until)
        if b > a:
            busy, until = busy + b - a, b
    return busy / (t1 - t0)


async def window(p: Phase, trainer: Trainer, seconds: float, stream: Any) -> list[Req]:
    """One window of phase `p` (the stream's, or `seconds` without one); its requests."""
    t0 = time.perf_counter()
    reqs = await stream() if stream is not None else []
    if stream is None:
        await asyncio.sleep(seconds)
    t1 = time.perf_counter()
    p.windows.append((t0, t1))
    p.reqs += reqs
    p.steps += trainer.steps(t0, t1)
    p.busy_s += busy_share(reqs, t0, t1) * (t1 - t0)
    return reqs


def in_flight(reqs: list[Req], t: float) -> bool:
    return any(r.sent < t < (r.end or math.inf) for r in reqs)


def trainer_running(trainer: Trainer, t: float) -> bool:
    """Whether the trainer was training at `t` (its last yield line before it
    is "resumed", or there is none)."""
    said = [x["state"] for at, x in trainer.lines if x["event"] == "yield" and at < t]
    return not said or said[-1] == "resumed"


def hold_latencies(p: Phase, trainer: Trainer, holds: list[float], reqs: list[Req]) -> None:
    """For each of one window's `reqs` that found the engine idle and the
    trainer training: from its send to the agent's pause file, and to the
    trainer's paused line."""
    t0, t1 = p.windows[-1]
    paused_at = [t for t, _ in trainer.yields("paused", t0, math.inf)]
    for r in reqs:
        if in_flight(reqs, r.sent) or not trainer_running(trainer, r.sent):
            continue
        file_at = next((h for h in holds if h >= r.sent), None)
        line_at = next((t for t in paused_at if t >= r.sent), None)
        if file_at is None or line_at is None or line_at > r.end:
            p.unseen += 1  # over before the trainer paused
            continue
        p.agent_s.append(file_at - r.sent)
        p.holds_s.append(line_at - r.sent)
    p.paused_s += sum(x["paused_s"] for _, x in trainer.yields("resumed", t0, t1))


def report(phases: list[Phase], a: argparse.Namespace) -> None:
    solo, alone, off, yielding = phases[0], phases[1], phases[2], phases[3:]
    print(
        f"\n{a.seconds:g} s a phase in {a.rounds} rounds; {a.rate:g} requests/s steady, then "
        f"{a.burst} every {a.burst_every_s:g} s; {a.tokens} tokens each; device {a.device}"
    )
    print(f"{'phase':<28}{'part':<8}{'reqs':>5}{'TTFT p50':>10}{'p99':>8}{'x alone':>8}"
          f"{'ITL p50':>9}{'p99':>8}{'x alone':>8}{'steps/s':>9}")  # fmt: skip
    base = {}
    for p in phases[1:]:
        for part in ("steady", "bursts", "all"):
            rs = [r for r in p.reqs if part in ("all", r.part) and r.ttft_s is not None]
            ttft = [1000 * r.ttft_s for r in rs if r.ttft_s is not None]
            itl = [1000 * g for r in rs for g in r.gaps_s]
            if p is alone:
                base[part] = (pct(ttft, 0.99), pct(itl, 0.99))
            bt, bi = base[part]
            steps = f"{p.steps_per_s:9.2f}" if part == "all" and p is not alone else ""
            print(f"{p.name:<28}{part:<8}{len(rs):>5}{pct(ttft, .5):>10.1f}{pct(ttft, .99):>8.1f}"
                  f"{pct(ttft, .99) / bt:>8.2f}{pct(itl, .5):>9.1f}{pct(itl, .99):>8.1f}"
                  f"{pct(itl, .99) / bi:>8.2f}{steps}")  # fmt: skip
    print(f"{solo.name:<28}{'':<8}{'':>5}{'':>10}{'':>8}{'':>8}{'':>9}{'':>8}{'':>8}"
          f"{solo.steps_per_s:9.2f}")  # fmt: skip
    idle = alone.idle_share
    allowed = idle * solo.steps_per_s
    print(
        f"\nengine idle {100 * idle:.0f}% of the windows alone; yielding off "
        f"{off.steps_per_s:.2f} steps/s; the target: >= 0.7 x the idle share of the solo rate"
    )
    for on in yielding:
        print(f"{on.name}: {on.steps_per_s:.2f} steps/s = {on.steps_per_s / allowed:.2f} x; "
              f"paused {on.paused_s:.1f} s of {on.seconds:.0f}; a request to an idle engine "
              "beside a training trainer, sent ->")  # fmt: skip
        for what, xs in (("  the agent's pause file", on.agent_s),
                         ("  the trainer paused", on.holds_s)):  # fmt: skip
            print(
                f"{what}: {len(xs)} pauses, p50 {1000 * pct(xs, 0.5):.0f} ms, "
                f"p99 {1000 * pct(xs, 0.99):.0f} ms, max {1000 * max(xs, default=0):.0f} ms"
            )
        print(f"  over before the trainer paused: {on.unseen} requests")


@contextlib.contextmanager
def engine(a: argparse.Namespace, work: Path) -> Any:
    if a.url:
        yield a.url, a.model, a.pid
        return
    from bench.serving_common import engine_python, tiny_model

    from lorafleet_services.local.vllm_launch import running_vllm

    python = Path(a.engine_python) if a.engine_python else engine_python()
    model = tiny_model(work)
    # On a card vLLM takes 90% of its memory by default: the trainer needs some.
    extra = ["--gpu-memory-utilization", "0.4"] if a.device == "cuda" else []
    with running_vllm(python, model, work / "vllm.log", extra_args=extra) as server:
        yield server.url, str(server.model_dir), server.pid


async def run_phases(
    a: argparse.Namespace, url: str, model: str, pid: int | None, work: Path
) -> list[Phase]:
    base = Path(model) if Path(model).is_dir() else Path(a.trainer_model or model)
    pause = PauseFile(work / "job" / "pause")
    job = write_job(
        work / "job", base, data=ndjson(qa_records(4)), device=a.device,
        params={"rank": 8, "max_steps": 1_000_000, "batch_size": 4, "max_seq_len": 64,
                "eval_fraction": 0.0, "dropout": 0.0},
        pause_path=str(pause.path),
    )  # fmt: skip
    trainer = Trainer(job)
    print("starting the trainer (its first step ends the wait)", flush=True)
    await trainer.start()
    seconds = a.seconds / a.rounds

    def stream() -> Any:
        return run_stream(url, model, seconds, a)

    # Each phase a window a round, in turn: a drift of the machine (where the
    # kernel put whose threads) falls on every phase alike.
    solo, alone, off = (
        Phase("1 trainer alone"),
        Phase("2 engine alone"),
        Phase("3 + training, yield off"),
    )
    reads = [("4 + yield on, /metrics", None)] + ([("5 + yield on, /proc", pid)] if pid else [])
    yielding = [Phase(name) for name, _ in reads]
    try:
        for _ in range(a.rounds):
            trainer.schedule(idle=False)
            await window(solo, trainer, seconds, None)
            pause.hold("bench: the engine alone")
            await window(alone, trainer, seconds, stream)
            pause.release()
            await window(off, trainer, seconds, stream)
            for on, (_, target_pid) in zip(yielding, reads, strict=True):
                trainer.schedule(idle=a.device == "cpu")
                async with YielderProcess(a, url, target_pid, pause.path) as yielder:
                    reqs = await window(on, trainer, seconds, stream)
                hold_latencies(on, trainer, yielder.holds, reqs)
        phases = [solo, alone, off, *yielding]
    finally:
        await trainer.stop()
    return phases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=30, help="each phase; default 30")
    ap.add_argument("--rate", type=float, default=2, help="steady requests/s; default 2")
    ap.add_argument("--burst", type=int, default=4, help="requests a burst; default 4")
    ap.add_argument("--burst-every-s", type=float, default=3, help="default 3")
    ap.add_argument("--tokens", type=int, default=32, help="tokens a request; default 32")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="the trainer's")
    ap.add_argument("--url", help="an engine already running (with --model: its model)")
    ap.add_argument("--model", help="the running engine's model (a directory: also trained)")
    ap.add_argument("--trainer-model", help="the base the trainer trains, when not --model")
    ap.add_argument("--engine-python", help="the vLLM interpreter; default the engines cache's")
    ap.add_argument("--rounds", type=int, default=3, help="windows a phase; default 3")
    ap.add_argument("--idle-s", type=float, help="the yielder's idle_s; default the node's")
    ap.add_argument("--pid", type=int, help="with --url: the engine's server process")
    ap.add_argument(
        "--metrics-only",
        action="store_true",
        help="the yielder reads /metrics only, as for an engine it cannot see",
    )
    ap.add_argument("--yielder", help=argparse.SUPPRESS)  # yielder_main's URL
    ap.add_argument("--pause", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.yielder:
        yielder_main(a.yielder, a.pid, Path(a.pause), a.idle_s)
        return
    if bool(a.url) != bool(a.model):
        raise SystemExit("--url and --model go together")
    with tempfile.TemporaryDirectory(prefix="colocation-") as tmp:
        work = Path(tmp)
        with engine(a, work) as (url, model, pid):
            phases = asyncio.run(run_phases(a, url, model, pid, work))
    report(phases, a)


if __name__ == "__main__":
    main()
