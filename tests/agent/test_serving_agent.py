"""The serving agent in a real agent process (the stand-in trainer, a real
nats-server), where no vLLM serves the job's model: llama.cpp's
restart_required with the exact flag, serve=true refused saying why, serve
unset or false reporting nothing, and node.serve/unserve answering at once
why there is nothing to do. The loads themselves are on the real vLLM
(tests/system/test_real_serving.py)."""

from __future__ import annotations

import msgspec

from lorafleet.nats import _bus as bus
from lorafleet_schemas.messages import (
    ArtifactKind,
    Engine,
    Heartbeat,
    NodeServeReply,
    NodeServeRequest,
    NodeUnserveRequest,
    ServingState,
    StartRequest,
)
from lorafleet_services.agent.serving.orders import NO_ENGINE
from lorafleet_trainer.standin import gguf_bytes
from tests.agent.conftest import Bus, finished, start_request
from tests.serving_reports import ServingReports, of
from tests.vllm_server import free_port

#: Seconds a report may take here: no load, no probe, the stand-in trainer.
REPORT_TIMEOUT_S = 30.0


def serving(req: StartRequest, serve: bool | None, engine: Engine = Engine.VLLM) -> StartRequest:
    model = msgspec.structs.replace(req.model, engine=engine)
    return msgspec.structs.replace(req, serve=serve, model=model)


async def test_serving_where_no_vllm_serves_the_model(fleet: Bus) -> None:
    # A configured engine that is not there: never a match, never waited for.
    nobody = f"http://127.0.0.1:{free_port()}"
    agent = await fleet.agent(vllm_servers=(nobody,), engines_refresh_s=0.5)
    names = fleet.settings.names
    reports = await ServingReports.of_node(fleet.js, names, "node-1")
    name, sha = await fleet.upload()
    work = fleet.tmp_path / "agent-node-1"

    # Unset (and no llama-server runs here) and false: nothing served, nothing reported.
    both = [ArtifactKind.PEFT, ArtifactKind.GGUF]
    for job_id, serve in (("job-unset", None), ("job-off", False)):
        req = serving(start_request(job_id, name, sha, artifacts=both), serve, Engine.LLAMACPP)
        assert (await fleet.start(req)).accepted
        await finished(agent, job_id)

    # llama.cpp: the GGUF where llama-server reads adapters, and the flag to add.
    gguf_job = start_request("job-gguf", name, sha, artifacts=both)
    assert (await fleet.start(serving(gguf_job, True, Engine.LLAMACPP))).accepted
    placed = await reports.next(
        of("job-gguf", ServingState.RESTART_REQUIRED, ServingState.FAILED), REPORT_TIMEOUT_S
    )
    path = work / "llamacpp-adapters" / f"{placed.served_name}.gguf"
    assert (placed.state, placed.lift) == (ServingState.RESTART_REQUIRED, f"--lora {path}")
    assert placed.engine == f"file://{work / 'llamacpp-adapters'}"
    assert placed.engine_kind is Engine.LLAMACPP and placed.model == "tiny"
    assert path.read_bytes() == gguf_bytes("job-gguf")
    assert "takes adapters only at its start" in placed.reason
    await finished(agent, "job-gguf")

    # llama.cpp without a GGUF asked for: refused, naming the fix.
    assert (await fleet.start(serving(start_request("job-nogguf", name, sha), True,
                                      Engine.LLAMACPP))).accepted  # fmt: skip
    no_gguf = await reports.next(of("job-nogguf", ServingState.REFUSED), REPORT_TIMEOUT_S)
    assert no_gguf.lift == "submit it with artifacts peft,gguf"
    await finished(agent, "job-nogguf")

    # serve=true and no engine serving the model: one refusal saying why.
    assert (await fleet.start(serving(start_request("job-on", name, sha), True))).accepted
    refused = await reports.next(
        of("job-on", ServingState.REFUSED, ServingState.LOADING), REPORT_TIMEOUT_S
    )
    assert refused.state is ServingState.REFUSED and refused.engine == NO_ENGINE
    assert refused.reason.startswith("no vLLM on node-1 serves '/models/tiny'")
    assert "--enable-lora" in refused.reason
    await finished(agent, "job-on")
    # Every report came in order, none for the jobs that asked nothing.
    assert [r.job_id for r in reports.items] == ["job-gguf", "job-nogguf", "job-on"]
    seqs = [r.seq for r in reports.items]
    assert seqs == sorted(set(seqs))
    # No staged copy is left where nothing serves it.
    assert sorted(p.name for p in (work / "served").iterdir()) == []

    # The heartbeat carries the configured engine, down: no adapters.
    kv = await fleet.js.key_value(names.nodes_bucket)
    hb = msgspec.json.decode((await kv.get("node-1")).value or b"", type=Heartbeat)
    assert [(e.url, e.adapters, e.kind) for e in hb.serving] == [(nobody, [], Engine.VLLM)]

    # node.serve / unserve say at once why there is nothing to do.
    serve = NodeServeRequest(
        job_id="job-on", model=gguf_job.model, object="job-on/peft", sha256=sha
    )
    reply = await bus.request(fleet.nc, names.node_serve("node-1"), serve, NodeServeReply)
    assert reply.engines == [] and reply.reason.startswith("no vLLM on node-1 serves")
    unserve = NodeUnserveRequest(job_id="job-on")
    reply = await bus.request(fleet.nc, names.node_unserve("node-1"), unserve, NodeServeReply)
    assert (reply.engines, reply.reason) == ([], "node-1 serves no version of job job-on")
