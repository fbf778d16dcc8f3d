"""Benchmark: an engine restarted with many adapters loaded -> every one
served again by the agent, several loads in flight (RELOAD_CONCURRENCY)
against one at a time (the baseline, run in the same script: the constant
set to 1, which is what the agent did before).

    .venv/bin/python bench/serving_reload.py [--adapters 24] [--slow-s 0.1] [--rounds 2]

One nats-server, the serving agent in this process (its engine watch at
0.5 s, preflight, load, the probe against the adapter's probe.json, its
reports) and the stand-in engine of tests/gateway/engine.py (vLLM's
interface), whose control file makes each load and each completion take
--slow-s after the restart, as a loaded engine's do. Timed: from the
restarted engine listening to the last `served` report. What is measured
is the agent's side; a real vLLM overlaps loads less than the stand-in
(its engine core takes them one by one), so the ratio is an upper bound.
Nemesis seed 25 found 46 adapters reloaded one at a time in about a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import sys
import tempfile
import time
from pathlib import Path

import msgspec

from lorafleet.nats import _bus as bus
from lorafleet.nats.server import NatsServer
from lorafleet.settings import Settings
from lorafleet_schemas.messages import Engine, ModelRecord, ServingReport, ServingState
from lorafleet_services.agent.config import AgentConfig
from lorafleet_services.agent.serving import agent as serving_agent
from lorafleet_services.agent.serving.orders import ServeOrder

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.*
from tests.agent.serving_in_process import StandinEngine, running_serving_agent, staged_adapter
from tests.vllm_server import free_port

#: Seconds the whole reload may take before the round is abandoned.
ROUND_TIMEOUT_S = 600.0


async def one_round(root: Path, adapters: int, slow_s: float, width: int) -> float:
    """Seconds from the restarted engine listening to every adapter served again."""
    serving_agent.RELOAD_CONCURRENCY = width
    base = root / "base"
    base.mkdir(parents=True)
    (base / "config.json").write_text(json.dumps({"model_type": "llama"}))
    control = root / "control.json"
    server = NatsServer(root / "nats")
    await server.start()
    settings = Settings(nats_url=server.url, data_dir=str(root / "data"))
    nc = await bus.connect(settings, "bench-reload")
    js = nc.jetstream()
    await bus.ensure_layout(js, bus.layout_for(settings))
    served: list[tuple[float, ServingReport]] = []

    async def on_report(msg: object) -> None:
        report = msgspec.json.decode(msg.data, type=ServingReport)  # type: ignore[attr-defined]
        if report.state is ServingState.SERVED:
            served.append((time.monotonic(), report))

    await nc.subscribe(f"{settings.names.prefix}.status.bench.*.serving", cb=on_report)
    engine = StandinEngine(base, free_port(), control, max_loras=2 * adapters)
    await engine.start()
    cfg = AgentConfig(node="bench", work_dir=root / "agent", trainer="standin",
                      vllm_servers=(engine.url,), engines_refresh_s=0.5)  # fmt: skip
    model = ModelRecord(name="tiny", engine=Engine.VLLM, hf_repo=None, hf_revision="main",
                        local_dir=str(base), description="",
                        created_at=dt.datetime.now(dt.UTC))  # fmt: skip
    try:
        async with running_serving_agent(js, settings.names, cfg) as agent:
            for i in range(adapters):
                path, sha = staged_adapter(root / "trained", f"job-{i}")
                agent.auto_serve(ServeOrder(job_id=f"job-{i}", model=model, sha256=sha,
                                            probe_base=str(base), adapter_dir=path))  # fmt: skip
            await agent.idle()
            for _ in range(100):  # the reports arrive a moment after the loads end
                if len(served) == adapters:
                    break
                await asyncio.sleep(0.1)
            else:
                raise SystemExit(f"only {len(served)} of {adapters} served before the restart")
            served.clear()
            control.write_text(json.dumps({"delay_s": slow_s}))
            await engine.kill()
            await engine.start()
            back = time.monotonic()
            deadline = back + ROUND_TIMEOUT_S
            while len({r.served_name for _, r in served}) < adapters:
                if time.monotonic() > deadline:
                    raise SystemExit(f"{len(served)} of {adapters} served again in time")
                await asyncio.sleep(0.05)
            return max(t for t, _ in served) - back
    finally:
        await engine.kill()
        await nc.close()
        await server.stop()


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapters", type=int, default=24)
    parser.add_argument("--slow-s", type=float, default=0.1)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    width = serving_agent.RELOAD_CONCURRENCY
    results: dict[int, list[float]] = {1: [], width: []}
    for r in range(args.rounds):
        for w in (1, width):  # alternated: the machine's load drifts
            with tempfile.TemporaryDirectory(prefix="bench-reload-") as d:
                seconds = await one_round(Path(d), args.adapters, args.slow_s, w)
            results[w].append(seconds)
            print(f"round {r + 1}, {w} in flight: {args.adapters} adapters served again "
                  f"in {seconds:.2f} s", flush=True)  # fmt: skip
    one, many = min(results[1]), min(results[width])
    print(f"best of {args.rounds}: one at a time {one:.2f} s, {width} in flight {many:.2f} s: "
          f"{one / many:.1f}x faster ({args.adapters} adapters, loads and probes of "
          f"{args.slow_s:g} s each)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
