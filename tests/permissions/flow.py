"""The whole flow with every process on its own nkey identity: recorder,
scheduler and artifact-store each as itself, the agent as node-1, and the
client as client/cli — upload a dataset, submit, watch it to `done`,
download the adapter. Used plain (test_identities) and over TLS (test_tls)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from lorafleet.client import INLINE_DATA_MAX_BYTES, Client
from lorafleet.log import Event
from lorafleet.nats import _bus as bus
from lorafleet_schemas.messages import ArtifactKind, Engine, JobRecord, JobSpec, ModelSpec
from tests.permissions.conftest import IdentityFleet
from tests.procs import ServiceProcess, agent_process

DATA = "".join(json.dumps({"q": f"what is {i}+{i}?", "a": str(2 * i)}) + "\n" for i in range(20))
#: An evaluation set over INLINE_DATA_MAX_BYTES: `with_data` uploads it, as the client.
HELD = "".join(
    json.dumps({"q": f"what is {i} times {i}?", "a": str(i * i)}) + "\n" for i in range(20_000)
).encode()
#: Seconds the job has to end (the stand-in trainer is fast).
JOB_TIMEOUT_S = 40.0


@dataclass
class IdentitySystem:
    fleet: IdentityFleet
    client: Client
    services: list[ServiceProcess] = field(default_factory=list)
    agent: ServiceProcess | None = None
    client_refusals: list[str] = field(default_factory=list)

    async def run_job(self, tmp_path: Path) -> tuple[JobRecord, Path]:
        """A job from upload to download, as the client identity."""
        base = tmp_path / "models" / "tiny"
        base.mkdir(parents=True, exist_ok=True)
        c = self.client
        await c.add_model(ModelSpec(name="tiny", engine=Engine.VLLM, local_dir=str(base)))
        dataset = await c.upload_dataset(DATA.encode())
        # Again (the same data resubmitted): found, not put twice, nothing refused.
        assert await c.upload_dataset(DATA.encode()) == dataset
        job = await c.submit(
            JobSpec(model="tiny", gpu_memory_mib=1000, dataset=dataset, node="node-1")
        )
        job = await c.wait(job.id, timeout_s=JOB_TIMEOUT_S)
        # The data inline, the evaluation set too large for that: uploaded and named.
        spec = JobSpec(model="tiny", gpu_memory_mib=1000, node="node-1")
        sent = await c.with_data(spec, DATA.encode(), HELD)
        assert len(HELD) > INLINE_DATA_MAX_BYTES and sent.eval_data is None
        assert sent.data == DATA and sent.eval_dataset is not None and sent.dataset is None
        held = await c.wait((await c.submit(sent)).id, timeout_s=JOB_TIMEOUT_S)
        assert held.state.value == "done", held.message
        assert (held.eval_dataset, held.eval_records) == (sent.eval_dataset, 20_000)
        out = tmp_path / "peft.tar.gz"
        await c.download(job.id, ArtifactKind.PEFT, out)
        return job, out

    def refusals(self) -> dict[str, list[str]]:
        """Every refusal any process heard, by process (the agent's expected
        attempt to create the layout left out)."""
        said: dict[str, list[str]] = {"client": list(self.client_refusals)}
        for proc in [*self.services, *([self.agent] if self.agent else [])]:
            lines = proc.events(Event.NATS_REFUSED)
            said[proc.module] = [
                ln["message"]
                for ln in lines
                if "may not create the JetStream layout" not in ln["message"]
            ]
        return {k: v for k, v in said.items() if v}


@contextlib.asynccontextmanager
async def identity_system(
    fleet: IdentityFleet, tmp_path: Path, database_url: str
) -> AsyncIterator[IdentitySystem]:
    """Services, agent and client, each on its identity, started in that order."""
    refusals: list[str] = []
    settings = fleet.settings_for("client", "cli")
    nc = await bus.connect(settings, "test-client", on_refused=refusals.append)
    system = IdentitySystem(fleet, Client(nc, settings), client_refusals=refusals)
    try:
        for module, name in (
            ("recorder", "recorder"),
            ("artifact_store", "artifact-store"),
            ("scheduler", "scheduler"),
        ):
            own = fleet.settings_for("service", name).with_(database_url=database_url)
            proc = ServiceProcess(f"lorafleet_services.{module}", own)
            system.services.append(proc)
            await proc.start()
        system.agent = agent_process(fleet.settings_for("node", "node-1"), tmp_path, "node-1")
        await system.agent.start()
        yield system
    finally:
        # Shown by pytest when the test fails: what the server refused, and to whom.
        print("server refusals:", *fleet.server_refusals(), sep="\n")
        for proc in [*([system.agent] if system.agent else []), *reversed(system.services)]:
            with contextlib.suppress(Exception):
                await proc.stop(timeout_s=5)
        await system.client.close()
