"""Job done -> first completion with its adapter: the agent's load into the
running vLLM against restarting the server with `--lora-modules`.

    nice -n 5 .venv/bin/python bench/serving_latency.py [--agent-runs 5] [--restart-runs 3]
        [--program-runs 1]

One real vLLM at a time (the CPU build from the engines cache, the tests'
server: tests/vllm_server.py), serving the tiny Llama; one real PEFT adapter
on it (rank 8, built on the spot: bench/serving_common.py). Each run starts
when the adapter directory is there (the job is done) and ends when a
completion with the adapter has come back:

- agent: into the server already running (it has answered the base before,
  as a node's engine has): PEFT's probe reference (`adapter_reference`: the
  adapter's probe.json, written by the trainer before `done`), `serve_adapter`
  (preflight, copy, load, confirm by the probe), one completion with
  `model=<served name>`. Every run is a new adapter version (a new job id: a
  new name), so each is a real load.
- agent, older adapter (--program-runs): the same with an adapter without
  probe.json, so the reference is the probe program's (a process of its own
  that imports torch, transformers and peft and loads base and adapter).
- restart, what a user does today: stop the server, start it again with
  `--lora-modules NAME=PATH`, wait for /health, one completion with
  `model=NAME`.

The agent runs go first, the restarts after them (each restart leaves the
server it started for the next to stop). Printed: each run's parts, the
medians, and restart / agent (the target is at least 10); the first agent
run apart too, because vLLM's first request with any adapter after its start
is slow (tens of seconds on two cores) and the restart pays it every time.
Both ways answer the same text: checked, so that both served the adapter.
Also printed: the agent's path without the reference, and the probe
program's CPU seconds (its wall time on an idle machine, about).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for bench.*, tests.*

from bench.serving_common import adapter, engine_python, scanned, tiny_model, to_serve
from tests.vllm_server import RunningVllm, running_vllm

from lorafleet_services.agent.serving.vllm_adapters import (
    Served,
    adapter_reference,
    serve_adapter,
    unserve_adapter,
)
from lorafleet_services.agent.serving.vllm_client import PROBE_REQUEST_TIMEOUT_S, VllmClient

PROMPT = "What is the capital of France?"
TARGET_RATIO = 10.0


async def agent_run(server: RunningVllm, adapter_dir: Path, work: Path, n: int) -> dict[str, Any]:
    """One adapter version served the agent's way, then one completion with it."""
    engine = scanned(server.url)
    to_load = to_serve(f"bench-{n}", adapter_dir, server.model_dir)
    async with VllmClient(server.url, timeout_s=PROBE_REQUEST_TIMEOUT_S) as client:
        t0, cpu0 = time.perf_counter(), _children_cpu_s()
        reference = await adapter_reference(sys.executable, server.model_dir, adapter_dir)
        t1, cpu1 = time.perf_counter(), _children_cpu_s()
        result = await serve_adapter(client, engine, to_load, reference, work)
        if not isinstance(result, Served):
            raise SystemExit(f"the agent's load failed: {result}")
        t2 = time.perf_counter()
        text = await client.complete(result.name, PROMPT)
        t3 = time.perf_counter()
        await unserve_adapter(client, result.name, work)
    return {
        "total_s": t3 - t0,
        "reference_s": t1 - t0,
        "load_and_confirm_s": t2 - t1,
        "completion_s": t3 - t2,
        "without_reference_s": t3 - t1,
        # The probe's own CPU seconds: what its wall time is on an idle machine, about.
        "reference_cpu_s": cpu1 - cpu0,
        "text": text,
    }


def _children_cpu_s() -> float:
    """CPU seconds of this process's ended children (the PEFT probe, here)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


async def _complete(url: str, model: str) -> str:
    async with VllmClient(url, timeout_s=PROBE_REQUEST_TIMEOUT_S) as client:
        return await client.complete(model, PROMPT)


def restart_run(
    stack: contextlib.ExitStack, model_dir: Path, adapter_dir: Path, work: Path, n: int
) -> tuple[dict[str, Any], contextlib.ExitStack]:
    """Stop the server `stack` holds, start one with the adapter, one
    completion; answers the times and the stack that holds the new server."""
    name = f"restart-{n}"
    t0 = time.perf_counter()
    stack.close()
    t1 = time.perf_counter()
    started = contextlib.ExitStack()
    server = started.enter_context(
        running_vllm(
            engine_python(),
            model_dir,
            work / f"vllm-restart-{n}.log",
            extra_args=["--lora-modules", f"{name}={adapter_dir}"],
            warm_up=False,
        )
    )
    t2 = time.perf_counter()
    text = asyncio.run(_complete(server.url, name))
    t3 = time.perf_counter()
    times = {"total_s": t3 - t0, "stop_s": t1 - t0, "start_s": t2 - t1, "completion_s": t3 - t2}
    return {**times, "text": text}, started


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = [k for k in runs[0] if k.endswith("_s")]
    return {
        "median": {k: round(statistics.median(r[k] for r in runs), 3) for k in keys},
        "runs": [{k: round(r[k], 3) for k in keys} for r in runs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agent-runs", type=int, default=5, help="default 5")
    ap.add_argument("--restart-runs", type=int, default=3, help="about 40 s+ each; default 3")
    ap.add_argument("--program-runs", type=int, default=1, help="older adapters; default 1")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir = tiny_model(work)
        adapter_dir = adapter(model_dir, work / "adapter", seed=1, probe=True)
        older_dir = adapter(model_dir, work / "older", seed=1)
        stack = contextlib.ExitStack()
        try:
            server = stack.enter_context(running_vllm(engine_python(), model_dir, work / "v.log"))
            base = asyncio.run(_complete(server.url, str(model_dir)))
            agent = []
            for n in range(args.agent_runs):
                agent.append(asyncio.run(agent_run(server, adapter_dir, work, n)))
                print(f"agent {n}: {agent[-1]['total_s']:.2f} s", file=sys.stderr, flush=True)
            program = []
            for n in range(args.program_runs):
                program.append(asyncio.run(agent_run(server, older_dir, work, 100 + n)))
                print(f"program {n}: {program[-1]['total_s']:.2f} s", file=sys.stderr, flush=True)
            restart = []
            for n in range(args.restart_runs):
                run, stack = restart_run(stack, model_dir, adapter_dir, work, n)
                restart.append(run)
                print(f"restart {n}: {run['total_s']:.2f} s", file=sys.stderr, flush=True)
        finally:
            stack.close()
    texts = {r["text"] for r in agent + program + restart}
    a, b = summary(agent), summary(restart)
    out = {
        "agent": a,
        "agent_first_s": round(agent[0]["total_s"], 3),
        "agent_after_first": summary(agent[1:]) if len(agent) > 1 else None,
        "restart": b,
        "ratio_restart_over_agent": round(b["median"]["total_s"] / a["median"]["total_s"], 1),
        "ratio_restart_over_agent_first": round(b["median"]["total_s"] / agent[0]["total_s"], 1),
        "ratio_restart_over_agent_without_reference": round(
            b["median"]["total_s"] / a["median"]["without_reference_s"], 1
        ),
        # Older adapters (no probe.json): the probe program on the path.
        "agent_program": summary(program) if program else None,
        "ratio_restart_over_agent_program": (
            round(b["median"]["total_s"] / summary(program)["median"]["total_s"], 1)
            if program
            else None
        ),
        "target_ratio": TARGET_RATIO,
        "same_answer_both_ways": len(texts) == 1,
        "answer_differs_from_base": base not in texts,
    }
    print(
        f"job done -> first completion with the adapter: agent {a['median']['total_s']:.2f} s, "
        f"restart {b['median']['total_s']:.2f} s (medians), "
        f"{out['ratio_restart_over_agent']}x; target >= {TARGET_RATIO:g}x",
        file=sys.stderr,
    )
    print(json.dumps(out, indent=2))
    if len(texts) != 1 or base in texts:
        raise SystemExit(f"the two ways answered differently, or as the base: {texts}, {base!r}")


if __name__ == "__main__":
    main()
