"""Training beside a serving engine: what the engine's users feel, with and
without the trainer yielding to them (agent/training/yielding.py).

    .venv/bin/python bench/colocation.py [--seconds 30] [--rate 2] [--device cpu|cuda]
        [--url URL --model PATH]

One real vLLM (the CPU build from the engines cache, serving the tiny Llama
as the tests' server does; `--url`/`--model`: one already running) and one
real trainer (`python -m lorafleet_trainer`, LoRA on the same tiny Llama,
its steps without end) started once and kept for every phase. A request
stream of streamed completions (`--tokens` each), the same in every phase:
`--rate` a second, evenly spaced with a seeded jitter, for the first half
of the window ("steady"), then bursts of `--burst` at once every
`--burst-every-s` ("bursts": idle gaps between them). Phases, each
`--seconds`:

1. trainer alone: no stream; its steps a second (the solo rate);
2. engine alone: the stream, the trainer held paused by the pause file
   (it only looks at the file, every 20 ms);
3. stream + training, yielding off: no pause file, the trainer's threads
   at SCHED_OTHER;
4. stream + training, yielding on: the agent's Yielder (its real load
   reads and decision, the node's default thresholds) holds the file, and
   on the CPU the trainer's threads run at SCHED_IDLE, as a yielding CPU
   job's do.

Printed: per phase and part, requests, time to first token and the gap
between tokens (p50, p99, ms) as the client sees them, each p99 against the
engine alone; the trainer's steps a second against its share of the solo
rate the engine's idle time allows (the target: at least 0.7 x that); and
how fast a pause takes hold: from the request that made the engine busy
being sent to the trainer's "yield paused" line, with the agent's part (to
the pause file written) apart. vLLM's gauges count a request only once
an engine step has taken it, so the first request after a quiet spell is
seen late and meets the trainer's step in flight: the bursts' first
requests pay that, the ones after them do not. On a shared machine every
figure is noisy: compare phases of one run, never runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
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
    """The agent's Yielder, noting when it writes the pause file."""

    holds: list[float]

    def _apply(self, before: YieldState, now: float) -> None:
        if self.state.paused and not before.paused:
            self.holds.append(now)
        super()._apply(before, now)


@dataclass
class Phase:
    name: str
    t0: float
    t1: float
    reqs: list[Req]
    steps: int
    holds_s: list[float] = field(default_factory=list)
    agent_s: list[float] = field(default_factory=list)
    paused_s: float = 0.0
    #: Requests to an idle engine that were over before the trainer paused.
    unseen: int = 0

    @property
    def steps_per_s(self) -> float:
        return self.steps / (self.t1 - self.t0)


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


async def phase(name: str, trainer: Trainer, seconds: float, stream: Any) -> Phase:
    t0 = time.perf_counter()
    reqs = await stream() if stream is not None else []
    if stream is None:
        await asyncio.sleep(seconds)
    t1 = time.perf_counter()
    return Phase(name, t0, t1, reqs, trainer.steps(t0, t1))


def in_flight(reqs: list[Req], t: float) -> bool:
    return any(r.sent < t < (r.end or math.inf) for r in reqs)


def trainer_running(trainer: Trainer, t: float) -> bool:
    """Whether the trainer was training at `t` (its last yield line before it
    is "resumed", or there is none)."""
    said = [x["state"] for at, x in trainer.lines if x["event"] == "yield" and at < t]
    return not said or said[-1] == "resumed"


def hold_latencies(p: Phase, trainer: Trainer, holds: list[float]) -> None:
    """For each request that found the engine idle and the trainer training:
    from its send to the agent's pause file, and to the trainer's paused line."""
    paused_at = [t for t, _ in trainer.yields("paused", p.t0, math.inf)]
    for r in p.reqs:
        if in_flight(p.reqs, r.sent) or not trainer_running(trainer, r.sent):
            continue
        file_at = next((h for h in holds if h >= r.sent), None)
        line_at = next((t for t in paused_at if t >= r.sent), None)
        if file_at is None or line_at is None or line_at > r.end:
            p.unseen += 1  # over before the trainer paused
            continue
        p.agent_s.append(file_at - r.sent)
        p.holds_s.append(line_at - r.sent)
    p.paused_s = sum(x["paused_s"] for _, x in trainer.yields("resumed", p.t0, p.t1))


def report(phases: list[Phase], a: argparse.Namespace) -> None:
    solo, alone = phases[0], phases[1]
    print(f"\n{a.seconds:g} s a phase; {a.rate:g} requests/s steady, then {a.burst} every "
          f"{a.burst_every_s:g} s; {a.tokens} tokens each; device {a.device}")  # fmt: skip
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
    idle = 1 - busy_share(alone.reqs, alone.t0, alone.t1)
    print(f"{solo.name:<28}{'':<8}{'':>5}{'':>10}{'':>8}{'':>8}{'':>9}{'':>8}{'':>8}"
          f"{solo.steps_per_s:9.2f}")  # fmt: skip
    on = phases[-1]
    allowed = idle * solo.steps_per_s
    print(
        f"\nengine idle {100 * idle:.0f}% of the window alone; yielding on kept "
        f"{on.steps_per_s:.2f} steps/s = {on.steps_per_s / allowed:.2f} x the idle share of "
        f"the solo rate (target >= 0.7); yielding off {phases[2].steps_per_s:.2f} steps/s"
    )
    print("a request to an idle engine beside a training trainer, sent ->")
    for what, xs in (("  the agent's pause file", on.agent_s),
                     ("  the trainer paused", on.holds_s)):  # fmt: skip
        print(
            f"{what}: {len(xs)} pauses, p50 {1000 * pct(xs, 0.5):.0f} ms, "
            f"p99 {1000 * pct(xs, 0.99):.0f} ms, max {1000 * max(xs, default=0):.0f} ms"
        )
    print(f"  over before the trainer paused: {on.unseen} requests")
    print(f"trainer paused {on.paused_s:.1f} s of phase 4's {on.t1 - on.t0:.0f} s")


@contextlib.contextmanager
def engine(a: argparse.Namespace, work: Path) -> Any:
    if a.url:
        yield a.url, a.model
        return
    from bench.serving_common import engine_python, tiny_model

    from lorafleet_services.local.vllm_launch import running_vllm

    python = Path(a.engine_python) if a.engine_python else engine_python()
    model = tiny_model(work)
    # On a card vLLM takes 90% of its memory by default: the trainer needs some.
    extra = ["--gpu-memory-utilization", "0.4"] if a.device == "cuda" else []
    with running_vllm(python, model, work / "vllm.log", extra_args=extra) as server:
        yield server.url, str(server.model_dir)


async def run_phases(a: argparse.Namespace, url: str, model: str, work: Path) -> list[Phase]:
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

    def stream() -> Any:
        return run_stream(url, model, a.seconds, a)

    try:
        trainer.schedule(idle=False)
        phases = [await phase("1 trainer alone", trainer, a.seconds, None)]
        pause.hold("bench: the engine alone")
        phases.append(await phase("2 engine alone", trainer, a.seconds, stream))
        pause.release()
        phases.append(await phase("3 + training, yield off", trainer, a.seconds, stream))
        th = YieldThresholds()
        target = LoadTarget(url, LoadSource.VLLM_METRICS)
        yielder = TimedYielder(pause, lambda: [target], th, Quiet())
        yielder.holds = []
        trainer.schedule(idle=a.device == "cpu")
        task = asyncio.create_task(yielder.run())
        try:
            on = await phase("4 + training, yield on", trainer, a.seconds, stream)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        hold_latencies(on, trainer, yielder.holds)
        phases.append(on)
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
    a = ap.parse_args()
    if bool(a.url) != bool(a.model):
        raise SystemExit("--url and --model go together")
    with tempfile.TemporaryDirectory(prefix="colocation-") as tmp:
        work = Path(tmp)
        with engine(a, work) as (url, model):
            phases = asyncio.run(run_phases(a, url, model, work))
    report(phases, a)


if __name__ == "__main__":
    main()
