"""The serving agent: finished adapters loaded into the node's running
engines, kept there, and reported.

Asked three ways, each answered off the job's path (a task of its own; the
node takes the next job meanwhile): auto-serve once a job's artifacts are
delivered (`job_delivered`), `node.<node>.serve` and `node.<node>.unserve`.
Each load is preflight, eviction when the engine is full (plan.py), the
PEFT reference, load and confirm (vllm_adapters.py), one change at a time
on the node (a lock: slots are counted from one /v1/models read). The
desired set (plan.DesiredSet) is loaded again into an engine that lost it,
as the engine watch sees: all it lost at once, one /v1/models read and up
to RELOAD_CONCURRENCY loads and probes in flight (one at a time, an engine
restarted with 46 adapters took a minute to serve them again); an ask to
serve a version the set holds joins that reload (`asked_again`); llama.cpp is
llamacpp.py's; reports, reports.py.
How each step behaves, and what an operator sees: docs/fine-tune-and-serve.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Coroutine, Mapping
from pathlib import Path
from typing import Any

import msgspec
from nats.js import JetStreamContext

from lorafleet import log
from lorafleet._tasks import at_most, stop_tasks
from lorafleet.log import Event
from lorafleet.names import Names
from lorafleet_schemas.messages import (
    ArtifactKind,
    Engine,
    NodeServeReply,
    NodeServeRequest,
    NodeUnserveRequest,
    ServingState,
    StartRequest,
)
from lorafleet_services.agent.config import AgentConfig
from lorafleet_services.agent.environment.protocol import TrainerSetupError
from lorafleet_services.agent.peft_adapter import AdapterConfigError
from lorafleet_services.agent.serving.engine_watch import EngineView, EngineWatch
from lorafleet_services.agent.serving.llamacpp import llamacpp_key, serve_llamacpp
from lorafleet_services.agent.serving.orders import (
    NO_ENGINE,
    AdapterFetchError,
    ServeOrder,
    fetch_adapter,
    matching_engines,
    model_base,
    no_engine_reason,
    order_from_job,
    read_model_type,
)
from lorafleet_services.agent.serving.plan import (
    DESIRED_FILE,
    DesiredAdapter,
    DesiredSet,
    ReloadBackoff,
    eviction_choice,
    needs_reload,
    remove_stale_copies,
)
from lorafleet_services.agent.serving.probe_references import ProbeReferences
from lorafleet_services.agent.serving.reports import AdapterVersion, ServingReporter
from lorafleet_services.agent.serving.running_engines import VllmServer, llama_server_running
from lorafleet_services.agent.serving.vllm_adapters import (
    AdapterToServe,
    ProbeError,
    Served,
    ServeRefused,
    loaded_adapters,
    preflight,
    serve_adapter,
)
from lorafleet_services.agent.serving.vllm_client import VllmClient, VllmError, VllmRequestError
from lorafleet_trainer.layout import ADAPTER_CONFIG

#: The longest wait between two tries of a reload that keeps failing: an
#: engine that comes back able to take it is served again within this.
RELOAD_BACKOFF_MAX_S = 300.0
#: Loads (each with its probe completion) in flight at once when an engine
#: lost several adapters: the engine overlaps their round trips and batches
#: the probes; more gains little on a loaded engine and delays its users.
RELOAD_CONCURRENCY = 4


class ServingAgent:
    """This node's serving (module doc)."""

    def __init__(self, js: JetStreamContext, names: Names, cfg: AgentConfig) -> None:
        self.js = js
        self.names = names
        self.cfg = cfg
        self.node = cfg.node
        self.watch = EngineWatch(
            cfg.vllm_servers, cfg.engines_refresh_s, cfg.node, cfg.advertise_host
        )
        self.watch.on_read = self._engines_read
        self.desired = DesiredSet.load(cfg.served_dir / DESIRED_FILE)
        self.reports = ServingReporter(js, names, cfg.node)
        self.references = ProbeReferences(cfg)
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        self._reloading: set[tuple[str, str]] = set()
        self.backoff = ReloadBackoff(cfg.engines_refresh_s, RELOAD_BACKOFF_MAX_S)
        self.logger = log.get(node=cfg.node)

    # --- lifecycle ------------------------------------------------------------

    def start(self, stop: asyncio.Event) -> list[asyncio.Task[None]]:
        """The watch and the report publisher, as tasks (the agent stops them)."""
        in_use = self.desired.paths_in_use()
        for name in remove_stale_copies(self.cfg.served_dir, in_use):
            self.logger.info(Event.SERVING_CHANGED, served_name=name, state="copy removed")
        self.reports.start()
        return [asyncio.create_task(self.watch.run(stop), name="engine-watch")]

    async def stop(self, timeout_s: float) -> None:
        """Stop what is under way; publish what is queued for at most `timeout_s`."""
        await stop_tasks(*self._tasks)
        await self.reports.stop(timeout_s)

    async def idle(self) -> None:
        """Until nothing is under way (tests, the demo)."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(self._logged(coro))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _logged(self, coro: Coroutine[Any, Any, None]) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.logger.exception(Event.SERVING_CHANGED, state="error", error=repr(e))

    # --- asked --------------------------------------------------------------

    def auto_serve(self, order: ServeOrder) -> None:
        """A finished job's adapter (staged): serve it where its model runs."""
        self._spawn(self._auto(order))

    async def job_delivered(
        self,
        req: StartRequest,
        adapter_dir: Path,
        base_dir: Path,
        shas: Mapping[ArtifactKind, str],
        files: Mapping[ArtifactKind, Path],
        job_dir: Path,
    ) -> None:
        """A job's artifacts are delivered: stage its adapter out of the job
        directory (which goes once this returns), then auto-serve it."""
        order = await asyncio.to_thread(
            order_from_job, req, self.cfg, adapter_dir, base_dir, shas, files, job_dir
        )
        self.auto_serve(order)

    async def serve_request(self, req: NodeServeRequest) -> NodeServeReply:
        order = ServeOrder(
            job_id=req.job_id, model=req.model, sha256=req.sha256, probe_base="",
            serve=True, engine=req.engine, object=req.object, placed=req.placed,
        )  # fmt: skip
        if req.model.engine is Engine.LLAMACPP:
            self._spawn(self._llamacpp(order))
            return NodeServeReply(engines=[llamacpp_key(self.cfg)])
        servers = await self._matching(order)
        if not servers:
            return NodeServeReply(reason=no_engine_reason(self.node, order))
        self._spawn(self._fetch_and_serve(order, servers))
        return NodeServeReply(engines=[s.url for s in servers])

    async def unserve(self, req: NodeUnserveRequest) -> NodeServeReply:
        held = self.desired.of_job(req.job_id, req.engine)
        if not held:
            where = f" on {req.engine}" if req.engine else ""
            return NodeServeReply(
                reason=f"{self.node} serves no version of job {req.job_id}{where}"
            )
        self._spawn(self._unserve(held, "unserved on request"))
        return NodeServeReply(engines=sorted({url for url, _ in held}))

    # --- vLLM -----------------------------------------------------------------

    async def _matching(self, order: ServeOrder) -> list[VllmServer]:
        if not self.watch.reads:
            await self.watch.refresh()
        servers = [v.server for v in self.watch.views.values()]
        return matching_engines(servers, order.model, order.engine)

    async def _llamacpp(self, order: ServeOrder) -> None:
        if order.serve is None and not await asyncio.to_thread(llama_server_running):
            if order.gguf is not None:  # not asked, and no llama-server here
                order.gguf.unlink(missing_ok=True)
            return
        await serve_llamacpp(order, self.cfg, self.js, self.names.artifacts_bucket, self.reports)

    async def _auto(self, order: ServeOrder) -> None:
        try:
            if order.model.engine is Engine.LLAMACPP:
                await self._llamacpp(order)
                return
            servers = await self._matching(order)
            if not servers and order.serve:
                lift = "an engine serving the model on the node"
                reason = no_engine_reason(self.node, order)
                self.reports.report(_version(order), NO_ENGINE, ServingState.REFUSED, reason,
                                    lift=lift)  # fmt: skip
            for server in servers:
                if order.adapter_dir is not None:
                    await self._serve_order_on(server, order, order.adapter_dir)
        finally:
            self.desired.drop_unused(order.adapter_dir)

    async def _fetch_and_serve(self, order: ServeOrder, servers: list[VllmServer]) -> None:
        servers = [
            s for s in servers if not asked_again(self.desired, self.backoff, self.watch, s, order)
        ]
        path = self.cfg.served_dir / order.served_name
        try:
            if not (path / ADAPTER_CONFIG).is_file():
                path = await fetch_adapter(
                    self.js, self.names.artifacts_bucket, order.object or "", order.sha256,
                    self.cfg.served_dir, order.served_name,
                )  # fmt: skip
        except AdapterFetchError as e:
            for server in servers:
                self.reports.report(_version(order), server.url, ServingState.FAILED, str(e))
            return
        try:
            for server in servers:
                await self._serve_order_on(server, order, path)
        finally:
            self.desired.drop_unused(path)

    async def _serve_order_on(self, server: VllmServer, order: ServeOrder, staged: Path) -> None:
        probe_base = order.probe_base or _local_base(server) or model_base(order.model)
        try:
            adapter = AdapterToServe.read(
                order.job_id, order.sha256, staged, model_base(order.model),
                read_model_type(probe_base),
            )  # fmt: skip
        except AdapterConfigError as e:
            reason = f"the adapter cannot be served: {e}"
            self.reports.report(_version(order), server.url, ServingState.FAILED, reason)
            return
        await self._serve_on(server, adapter, probe_base, order.model.name, "",
                             placed=order.placed)  # fmt: skip

    async def _serve_on(
        self,
        server: VllmServer,
        adapter: AdapterToServe,
        probe_base: str,
        model: str,
        note: str,
        *,
        reload: bool = False,
        placed: bool = False,
    ) -> bool:
        """Load `adapter` into `server` (the module doc's steps); True once served."""
        v = AdapterVersion(adapter.job_id, model, adapter.served_name, adapter.sha256)
        async with self._lock, VllmClient(server.url, server.api_key) as client:
            try:
                loaded = loaded_adapters(server, await client.models())
            except VllmError as e:
                self.reports.report(v, server.url, ServingState.FAILED, str(e))
                return False
            if reload and adapter.served_name in loaded:
                return True  # read before the load was seen: nothing was lost
            self.reports.report(v, server.url, ServingState.LOADING, note)
            done = await self._load(client, server, adapter, probe_base, v, loaded, placed)
        self.watch.poke()
        return done

    async def _load(
        self,
        client: VllmClient,
        server: VllmServer,
        adapter: AdapterToServe,
        probe_base: str,
        v: AdapterVersion,
        loaded: list[str],
        placed: bool = False,
    ) -> bool:
        desired = self.desired.on(server.url)
        victim = eviction_choice(desired, loaded, server.max_cpu_loras, adapter.served_name)
        holds = [n for n in loaded if n != victim]  # read under the lock: not read again
        refused = preflight(server, adapter, holds)
        if refused is not None:
            self.reports.report(
                v, server.url, ServingState.REFUSED, refused.reason, lift=refused.lift
            )
            return False
        try:
            reference = await self.references.of(adapter, probe_base)
        except (ProbeError, TrainerSetupError, TimeoutError, OSError, ValueError) as e:
            reason = f"the PEFT probe of {adapter.served_name} on {probe_base} failed: {e}"
            self.reports.report(v, server.url, ServingState.FAILED, reason)
            return False
        if victim is not None:
            await self._evict(client, server, victim, adapter.served_name)
        result = await serve_adapter(client, server, adapter, reference, self.cfg.work_dir, holds)
        if isinstance(result, Served):
            self.backoff.succeeded((server.url, adapter.served_name))
            self.desired.add(server.url, _desired(v, adapter, probe_base, result.path, placed))
            reason = f"loaded as {result.name}; probe within {result.probe_error:.2g} of PEFT"
            self.reports.report(v, server.url, ServingState.SERVED, reason,
                         probe_error=result.probe_error)  # fmt: skip
            return True
        if isinstance(result, ServeRefused):
            self.reports.report(
                v, server.url, ServingState.REFUSED, result.reason, lift=result.lift
            )
        else:
            self.reports.report(v, server.url, ServingState.FAILED, result.reason)
        return False

    async def _evict(
        self, client: VllmClient, server: VllmServer, name: str, for_name: str
    ) -> None:
        entry = self.desired.remove(server.url, name)
        with contextlib.suppress(VllmError):
            await client.unload_lora_adapter(name)
        if entry is not None:
            self.desired.drop_unused(Path(entry.path))
            self.reports.report(
                _version(entry), server.url, ServingState.UNLOADED, f"evicted for {for_name}"
            )

    # --- the engines restarting -------------------------------------------------

    async def _engines_read(self, views: list[EngineView], previous: dict[str, EngineView]) -> None:
        for view in views:
            if view.adapters is None:
                continue
            before = previous.get(view.server.url)
            pid_before = before.server.pid if before is not None else None
            lost = needs_reload(
                self.desired.on(view.server.url), view.adapters, pid_before, view.server.pid
            )
            due = [
                e for e in lost
                if (key := (view.server.url, e.served_name)) not in self._reloading
                and self.backoff.due(key)
            ]  # fmt: skip
            if due:
                self._reloading.update((view.server.url, e.served_name) for e in due)
                self._spawn(self._reload(view.server, due))

    async def _reload(self, server: VllmServer, entries: list[DesiredAdapter]) -> None:
        """Load `entries` again into `server`, which lost them: together when
        they all fit its --max-cpu-loras beside what it holds (no eviction
        among them), else one at a time as any load."""
        keys = [(server.url, e.served_name) for e in entries]
        try:
            staged = [(e, a) for e in entries if (a := self._staged_copy(server, e))]
            note = f"{server.url} lost it (restarted?): loading it again"
            async with self._lock, VllmClient(server.url, server.api_key) as client:
                try:
                    loaded = loaded_adapters(server, await client.models())
                except VllmError as e:
                    for entry, _ in staged:
                        self.reports.report(
                            _version(entry), server.url, ServingState.FAILED, str(e)
                        )
                        self._reload_failed(server, entry)
                    return
                todo = [(e, a) for e, a in staged if a.served_name not in loaded]
                limit = server.max_cpu_loras or server.max_loras
                together = limit is None or len(loaded) + len(todo) <= limit
                if together:

                    async def one(entry: DesiredAdapter, adapter: AdapterToServe) -> None:
                        v = _version(entry)
                        self.reports.report(v, server.url, ServingState.LOADING, note)
                        if not await self._load(client, server, adapter, entry.probe_base,
                                                v, loaded, entry.placed):  # fmt: skip
                            self._reload_failed(server, entry)

                    await at_most(RELOAD_CONCURRENCY, [one(e, a) for e, a in todo])
            if not together:
                for entry, adapter in todo:
                    if not await self._serve_on(
                        server, adapter, entry.probe_base, entry.model, note, reload=True,
                        placed=entry.placed,
                    ):  # fmt: skip
                        self._reload_failed(server, entry)
            self.watch.poke()
        finally:
            self._reloading.difference_update(keys)

    def _staged_copy(self, server: VllmServer, entry: DesiredAdapter) -> AdapterToServe | None:
        """The adapter as staged when it was first served; None (reported, and
        out of the desired set) when that copy is gone."""
        try:
            return AdapterToServe.read(
                entry.job_id, entry.sha256, Path(entry.path), entry.base_model, entry.model_type
            )
        except AdapterConfigError as e:
            self.desired.remove(server.url, entry.served_name)
            reason = f"its staged copy {entry.path} is gone ({e!r}): serve it again"
            self.reports.report(_version(entry), server.url, ServingState.FAILED, reason)
            return None

    def _reload_failed(self, server: VllmServer, entry: DesiredAdapter) -> None:
        delay_s = self.backoff.failed((server.url, entry.served_name))
        self.logger.warning("serving.reload_failed", engine=server.url,
                            adapter=entry.served_name, retry_in_s=delay_s)  # fmt: skip

    # --- unserve --------------------------------------------------------------

    async def _unserve(self, held: list[tuple[str, DesiredAdapter]], reason: str) -> None:
        async with self._lock:
            for url, entry in held:
                server = self.watch.server(url)
                async with VllmClient(url, server.api_key) as client:
                    try:
                        await client.unload_lora_adapter(entry.served_name)
                    except VllmRequestError as e:
                        if e.status != 404:
                            self.reports.report(_version(entry), url, ServingState.FAILED, str(e))
                            continue
                    except VllmError:
                        pass  # gone with its engine; it will not be loaded again
                self.desired.remove(url, entry.served_name)
                self.desired.drop_unused(Path(entry.path))
                self.reports.report(_version(entry), url, ServingState.UNLOADED, reason)
        self.watch.poke()


def _version(item: ServeOrder | DesiredAdapter) -> AdapterVersion:
    model = item.model if isinstance(item.model, str) else item.model.name
    return AdapterVersion(item.job_id, model, item.served_name, item.sha256)


def _desired(
    v: AdapterVersion, adapter: AdapterToServe, probe_base: str, path: Path, placed: bool
) -> DesiredAdapter:
    return DesiredAdapter(
        job_id=v.job_id, served_name=v.served_name, sha256=v.sha256, model=v.model,
        base_model=adapter.base_model, model_type=adapter.model_type, probe_base=probe_base,
        path=str(path), served_at=time.time(), placed=placed,
    )  # fmt: skip


def _local_base(server: VllmServer) -> str | None:
    """The engine's --model when it is a directory here (the probe loads it)."""
    return server.model if server.model and Path(server.model).is_dir() else None


def asked_again(
    desired: DesiredSet, backoff: ReloadBackoff, watch: EngineWatch, server: VllmServer,
    order: ServeOrder,
) -> bool:  # fmt: skip
    """True when `server` should hold this version already (it is in the
    desired set): the ask is the reload's, not a load of its own. The engine
    is read again now, and what it lost is loaded with the rest it lost
    (together, RELOAD_CONCURRENCY at once), at once even when a failed
    reload was waiting out its back-off; what it lists stays as it is. As a
    load of its own, each ask would read, load and probe in turn under the
    node's lock: after an engine restart the placement asks for every `all`
    adapter at once, and hundreds of them kept the reload waiting behind
    them (nemesis seed 44)."""
    entry = desired.get(server.url, order.served_name)
    if entry is None:
        return False
    if order.placed and not entry.placed:
        desired.add(server.url, msgspec.structs.replace(entry, placed=True))
    backoff.succeeded((server.url, entry.served_name))
    watch.poke()
    return True
