"""Serving on llama.cpp: honest, never a pretend load.

llama-server re-weights only the adapters it was started with (`--lora`;
loading a new file at runtime is an open upstream change). So the agent
puts the GGUF where the node's llama-server reads its adapters
(`AgentConfig.llamacpp_adapters_dir`, default `<work_dir>/llamacpp-adapters`)
and reports `restart_required` with `lift` the exact flag to add. The
report's engine is that directory as a `file://` URL.
"""

from __future__ import annotations

import asyncio

from nats.js import JetStreamContext

from lorafleet_schemas.messages import Engine, ServingState
from lorafleet_services.agent.config import AgentConfig
from lorafleet_services.agent.serving.orders import (
    AdapterFetchError,
    ServeOrder,
    fetch_gguf,
    lora_flag,
    place_gguf,
)
from lorafleet_services.agent.serving.reports import AdapterVersion, ServingReporter


def llamacpp_key(cfg: AgentConfig) -> str:
    """ServingReport.engine for llama.cpp: where its adapters go."""
    return f"file://{cfg.llamacpp_adapters}"


async def serve_llamacpp(
    order: ServeOrder, cfg: AgentConfig, js: JetStreamContext, bucket: str, reports: ServingReporter
) -> None:
    """The order's GGUF (kept from the job, or fetched from `bucket`) put in
    place; one report: restart_required, or refused/failed saying why."""
    v = AdapterVersion(order.job_id, order.model.name, order.served_name, order.sha256)
    key = llamacpp_key(cfg)
    target = cfg.llamacpp_adapters / f"{order.served_name}.gguf"
    try:
        if order.gguf is not None:
            path = await asyncio.to_thread(
                place_gguf, order.gguf, cfg.llamacpp_adapters, order.served_name
            )
        elif order.object is not None:
            path = await fetch_gguf(js, bucket, order.object, order.sha256, target)
        else:
            reason = "the job asked for no GGUF artifact: llama.cpp serves GGUF adapters"
            lift = "submit it with artifacts peft,gguf"
            reports.report(v, key, ServingState.REFUSED, reason, lift=lift, kind=Engine.LLAMACPP)
            return
    except (AdapterFetchError, OSError) as e:
        reports.report(v, key, ServingState.FAILED, str(e), kind=Engine.LLAMACPP)
        return
    finally:
        if order.gguf is not None:
            order.gguf.unlink(missing_ok=True)
    reason = (
        f"llama-server takes adapters only at its start: {path} is in place; restart it "
        "with the flag in lift"
    )
    reports.report(
        v, key, ServingState.RESTART_REQUIRED, reason, lift=lora_flag(path), kind=Engine.LLAMACPP
    )
