"""The nemesis's fleet: every process of lorafleet this machine holds, made of
the tests' own stack code, and the faults that can be done to it.

`fleet(root, ...)` yields a `Fleet`: a three-server NATS cluster (R3,
`sync_interval: always`; lorafleet.nats.cluster), a PostgreSQL of the run's
own (initdb + pg_ctl on a free port, as the `postgres` user, when the
binaries are here; else a throwaway database on the shared server, never
restarted), two recorders, two schedulers, the artifact-store
(tests/system/conftest.py's `running_stack`, plus one of each more) and
three agents with the stand-in trainer, an engine beside each agent
(tests/gateway/engine.py: a process with vLLM's interface; a real CPU vLLM
per node would take this 2-core machine's CPU the faults' timing depends
on) and two gateway replicas (each on a port of its own, kept across its
restarts) with two API keys in two projects. As root with `ip netns`, each
agent and its engine run in a network namespace of their own
(tests/partition/netns.py), the engine on the namespace's address (the
gateway reaches it through the node's link, as it would across hosts) and
the cluster listens on the host end of a fourth, "hub" link; each agent's
namespace has one route, to the hub's address, through its own veth pair.
Nothing listens beyond 127.0.0.0/8 and those pairs. Everything is removed
on the way out: processes, namespaces, the PostgreSQL cluster and its files.

`Fleet.kinds()` names the faults this machine allows and `Fleet.skipped`
says why the others are not done.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.*
from tests import clock_step, disks
from tests.control_file import write_control
from tests.gateway.engine import engine_argv
from tests.partition.helpers import agent_in
from tests.partition.netns import NetnsError, NetnsLink, available
from tests.pg import PrivatePostgres, throwaway_database
from tests.ports import free_port
from tests.system.conftest import Stack, running_stack, system_settings

from lorafleet.names import Names
from lorafleet.nats.cluster import NatsCluster
from lorafleet_services.gateway.api_keys import make_key
from lorafleet_services.stack import ServiceProcess

#: The agents' node names.
NODES = ("node-1", "node-2", "node-3")
#: Seconds per stand-in step (each job says how many steps: max_steps).
STEP_S = 0.1
#: The recorder's ack wait on the cluster (tests/cluster/helpers.py's reasoning).
RECORDER_ACK_WAIT_S = 5.0
#: MiB of the private PostgreSQL's own filesystem (the database's disk-full
#: fault): an hour's database and its WAL (tests/pg.py WAL_MIB) fit many times.
PG_DISK_MIB = 512
#: Seconds a delivered job may wait to be stored before the scheduler takes
#: it for lost: within the run's settle time, far above a store's seconds.
DELIVERY_STORE_WAIT_S = 60.0
#: What a degraded link carries at most (tc tbf: there is no sch_netem here).
DEGRADED_KBIT_S = 256
#: MiB of each member's object-store filesystem, and more per minute of
#: faults: what a run keeps (artifacts and checkpoints of ~20 jobs a minute,
#: ~1 MiB) grows with it. A 60-minute run on a fixed 64 MiB filled all three
#: members' for good; nats-server then disables JetStream on each, and the
#: cluster had no meta leader from minute 46.
OBJECTS_DISK_MIB = 64
OBJECTS_DISK_MIB_PER_MINUTE = 4
#: The gateway replicas' names.
GATEWAYS = ("gateway-1", "gateway-2")
#: API key name -> its project (two projects: what one makes, the other must not see).
KEYS = {"alice": "proj-a", "bob": "proj-b"}
#: Adapters an engine may hold (the agent evicts past it; the run loads
#: fewer, so an adapter leaves an engine only when it is unserved or moved).
ENGINE_MAX_LORAS = 500
#: Seconds a chat with a fine-tuned model whose adapter is on its way waits
#: at the gateway (its default 60 s would hold the run's chats).
ADAPTER_LOAD_WAIT_S = 5.0


class EngineProcess(ServiceProcess):
    """A node's stand-in engine (tests/gateway/engine.py, vLLM's interface) on a
    fixed address, in the node's namespace when it has one; its `control`
    file turns it slow or refusing loads."""

    def __init__(
        self, stack: Stack, node: str, base: Path, link: NetnsLink | None, env: dict[str, str]
    ) -> None:
        host = link.ns_ip if link is not None else "127.0.0.1"
        self.node = node
        self.netns = link.ns if link is not None else None
        self.url = f"http://{host}:{free_port()}"
        self.base = base
        self.control = stack.tmp_path / f"engine-{node}.control.json"
        root = str(Path(__file__).resolve().parents[1])
        env = {
            **env,
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true",
            "LORAFLEET_STANDIN_ENGINE_CONTROL": str(self.control),
            "LORAFLEET_STANDIN_ENGINE_SAY_STARTED": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
        }
        super().__init__("tests.gateway.engine", stack.settings, env=env)

    def command(self) -> list[str]:
        port = self.url.rsplit(":", 1)[1]
        host = self.url.split("//", 1)[1].rsplit(":", 1)[0]
        argv = [*engine_argv(str(self.base), int(port), ENGINE_MAX_LORAS), "--host", host]
        return ["ip", "netns", "exec", self.netns, *argv] if self.netns else argv

    def set_control(self, **settings: object) -> None:
        """Slow it or make it refuse loads (an empty call: back to normal)."""
        if settings:
            write_control(self.control, json.dumps(settings))
        else:
            self.control.unlink(missing_ok=True)


@dataclass
class Fleet:
    stack: Stack
    cluster: NatsCluster
    pg: PrivatePostgres | None
    links: dict[str, NetnsLink]
    #: Fault kinds not done on this machine, and why.
    skipped: dict[str, str]
    recorders: list[ServiceProcess] = field(default_factory=list)
    #: Member -> the filesystem of its object store's stream (disk.full).
    object_disks: dict[str, Path] = field(default_factory=dict)
    #: Member -> the stall of the slow filesystem its whole store is on (disk.slow).
    slow_disks: dict[str, disks.SlowDisk] = field(default_factory=dict)
    #: Node -> its engine.
    engines: dict[str, EngineProcess] = field(default_factory=dict)
    #: Node -> the wall clock its agent, trainers and engine read (clock.step).
    clocks: dict[str, clock_step.NodeClock] = field(default_factory=dict)
    #: Replica name -> the gateway process, and its URL.
    gateways: dict[str, ServiceProcess] = field(default_factory=dict)
    gateway_urls: dict[str, str] = field(default_factory=dict)
    #: API key -> (its key name, its project).
    keys: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: "<gateway> upload" / "<gateway> stream" -> requests of that kind in
    #: flight on it now (the run counts them; the mid-request faults wait for one).
    in_flight: dict[str, int] = field(default_factory=dict)

    def services(self) -> dict[str, ServiceProcess]:
        """Every lorafleet process by a name of its own (agents as `agent <node>`)."""
        named: dict[str, ServiceProcess] = {}
        for i, proc in enumerate(self.recorders):
            named[f"recorder-{i + 1}"] = proc
        for i, proc in enumerate(self.stack.schedulers):
            named[f"scheduler-{i + 1}"] = proc
        if self.stack.artifact_store is not None:
            named["artifact-store"] = self.stack.artifact_store
        for node, proc in self.stack.agents.items():
            named[f"agent {node}"] = proc
        named.update(self.gateways)
        return named

    def restore_link(self, link: NetnsLink) -> None:
        """Bring `link` back up; its route to the hub went down with it."""
        link.restore()
        with contextlib.suppress(NetnsError):  # "File exists": it never went
            link.inside("ip", "route", "add", f"{self.links['hub'].host_ip}/32", "dev", link.ns_dev)

    def kinds(self) -> list[str]:
        kinds = ["process.sigkill", "process.sigterm", "process.pause"]
        kinds += ["nats.kill", "nats.restart", "nats.isolate", "nats.pause"]
        if self.pg is not None:
            kinds.append("postgres.restart")
            if self.pg.disk_mib is not None:
                kinds.append("postgres.disk_full")
        if self.links:
            kinds += ["link.cut", "link.degrade"]
        if self.object_disks:
            kinds.append("disk.full")
        if self.slow_disks:
            kinds.append("disk.slow")
        if self.engines:
            kinds += ["engine.kill", "engine.restart", "engine.slow", "engine.refuse_loads"]
        if self.gateways:
            kinds += ["gateway.kill_mid_upload", "gateway.kill_mid_stream"]
        if self.clocks:
            kinds.append("clock.step")
        return kinds


def _links(skipped: dict[str, str]) -> dict[str, NetnsLink]:
    why = available() if os.geteuid() == 0 else "not root"
    if why is not None:
        skipped["link.cut"] = skipped["link.degrade"] = why
        return {}
    links: dict[str, NetnsLink] = {}
    try:
        links["hub"] = NetnsLink().create()
        for node in NODES:
            link = links[node] = NetnsLink().create()
            link.inside("ip", "route", "add", f"{links['hub'].host_ip}/32", "dev", link.ns_dev)
    except NetnsError:
        for link in links.values():
            link.delete()
        raise
    return links


def _postgres(skipped: dict[str, str]) -> PrivatePostgres | None:
    why = PrivatePostgres.unavailable()
    if why is not None:
        skipped["postgres.restart"] = f"{why}: the shared PostgreSQL on :5432 is never restarted"
        skipped["postgres.disk_full"] = skipped["postgres.restart"]
        return None
    no_disk = disks.unavailable()
    if no_disk is not None:
        skipped["postgres.disk_full"] = no_disk
        return PrivatePostgres()
    return PrivatePostgres(disk_mib=PG_DISK_MIB)


@contextlib.asynccontextmanager
async def fleet(root: Path, orphan_age_s: float, minutes: float) -> AsyncIterator[Fleet]:
    """The whole fleet under `root` (see the module docstring), sized for
    `minutes` of faults; removed after."""
    skipped: dict[str, str] = {}
    links = _links(skipped)
    pg = _postgres(skipped)
    try:
        db_url = pg.start() if pg is not None else None
        host = links["hub"].host_ip if links else "127.0.0.1"
        cluster = NatsCluster(root / "cluster", host=host)
        with contextlib.ExitStack() as mounts:
            disk_mib = OBJECTS_DISK_MIB + round(OBJECTS_DISK_MIB_PER_MINUTE * minutes)
            slow_disks = _slow_disks(cluster, mounts, skipped)  # first: the object disk is in it
            object_disks = _object_disks(cluster, mounts, skipped, disk_mib)
            async with cluster, _made(cluster, root, db_url, orphan_age_s) as stack:
                made = Fleet(stack, cluster, pg, links, skipped, [stack.recorder], object_disks,
                             slow_disks=slow_disks, clocks=_clocks(root, skipped))  # fmt: skip
                await _more_services(made)
                yield made
    finally:
        if pg is not None:
            await asyncio.to_thread(pg.remove)
        for link in links.values():
            link.delete()


def _clocks(root: Path, skipped: dict[str, str]) -> dict[str, clock_step.NodeClock]:
    """A clock file per node, read by every process of the node (tests/clock_step.py)."""
    why = clock_step.unavailable()
    if why is not None:
        skipped["clock.step"] = why
        return {}
    library = clock_step.build(root / "clock")
    return {node: clock_step.NodeClock(library, root / "clock" / node) for node in NODES}


def _slow_disks(
    cluster: NatsCluster, mounts: contextlib.ExitStack, skipped: dict[str, str]
) -> dict[str, disks.SlowDisk]:
    """The first member's whole store on a slow filesystem (tests/slow_fs.py),
    mounted before the members start; one member: a stall under each would
    be a slow cluster, and each passthrough costs a process."""
    why = disks.slow_unavailable()
    if why is not None:
        skipped["disk.slow"] = why
        return {}
    first = cluster.names[0]
    disk = mounts.enter_context(disks.slow_filesystem(cluster.servers[first].store_dir))
    return {first: disk}


def _object_disks(
    cluster: NatsCluster, mounts: contextlib.ExitStack, skipped: dict[str, str], disk_mib: int
) -> dict[str, Path]:
    """A small filesystem under each member's object store (the artifact-store
    keeps no file: the disk that can fill is a member's), mounted before the
    members start; unmounted when `mounts` closes."""
    why = disks.unavailable()
    if why is not None:
        skipped["disk.full"] = why
        return {}
    names = Names()
    return {
        name: mounts.enter_context(
            disks.small_filesystem(
                disks.objects_dir(cluster.servers[name].store_dir, names), disk_mib
            )
        )
        for name in cluster.names
    }


@contextlib.asynccontextmanager
async def _made(
    cluster: NatsCluster, root: Path, db_url: str | None, orphan_age_s: float
) -> AsyncIterator[Stack]:
    """The stack on the cluster, its database the private PostgreSQL's or a throwaway."""
    with contextlib.ExitStack() as dbs:
        if db_url is None:
            db_url = dbs.enter_context(throwaway_database("lorafleet_nemesis"))
        settings = system_settings(cluster.url, db_url, root).with_(
            replicas=3,
            recorder_ack_wait_s=RECORDER_ACK_WAIT_S,
            artifact_orphan_age_s=orphan_age_s,
            delivery_store_wait_s=DELIVERY_STORE_WAIT_S,
        )
        first = cluster.servers[cluster.names[0]]
        async with running_stack(settings, first, root, "nemesis") as stack:
            yield stack


async def _more_services(made: Fleet) -> None:
    """The second recorder and scheduler, the model, the three engines and
    agents, and the two gateways."""
    stack = made.stack
    second = ServiceProcess("lorafleet_services.recorder", stack.settings)
    stack.procs.append(second)
    made.recorders.append(await second.start())
    await stack.scheduler()
    await stack.add_model()
    env = {"LORAFLEET_STANDIN_STEP_S": str(STEP_S)}
    base = stack.tmp_path / "models" / "tiny"
    for node in NODES:
        link = made.links.get(node)
        clock = made.clocks[node].env() if made.clocks else {}
        engine = made.engines[node] = EngineProcess(stack, node, base, link, clock)
        stack.procs.append(engine)
        await engine.start()
        cfg: dict[str, object] = {"vllm_servers": (engine.url,), "engines_refresh_s": 0.5}
        if link is not None:
            # The engine's address is the node's own: the agent's process scan
            # reads its flags (base model, max loras) as a local engine's.
            cfg["advertise_host"] = link.ns_ip
            await agent_in(stack, link, node, {**env, **clock}, **cfg)
        else:
            await stack.agent(node, {**env, **clock}, **cfg)
    keys_file = stack.tmp_path / "gateway-keys.json"
    for name, project in KEYS.items():
        made.keys[make_key(keys_file, name, project)] = (name, project)
    for name in GATEWAYS:
        url = f"http://127.0.0.1:{free_port()}"
        gw_env = {
            "LORAFLEET_GATEWAY_ADDR": url.split("//", 1)[1],
            "LORAFLEET_GATEWAY_API_KEYS_FILE": str(keys_file),
            "LORAFLEET_GATEWAY_ADAPTER_LOAD_WAIT_S": str(ADAPTER_LOAD_WAIT_S),
        }
        proc = ServiceProcess("lorafleet_services.gateway", stack.settings, env=gw_env)
        stack.procs.append(proc)
        made.gateways[name] = await proc.start()
        made.gateway_urls[name] = url


# --- faults: each a do and an undo --------------------------------------


def signal_process(proc: ServiceProcess, sig: signal.Signals) -> None:
    """`sig` to the process itself (not its group: a trainer is not the agent)."""
    if proc.proc is not None and proc.proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.proc.pid, sig)


async def restart_process(proc: ServiceProcess) -> None:
    """Reap it (SIGKILL if it still runs) and start it again as it was."""
    await proc.stop(timeout_s=5)
    await proc.start()


def pause_member(cluster: NatsCluster, name: str, sig: signal.Signals) -> None:
    server = cluster.servers[name]
    if server.proc is not None and server.proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server.proc.pid, sig)


def degrade(link: NetnsLink) -> None:
    link.limit(kbit_s=DEGRADED_KBIT_S)


def undegrade(link: NetnsLink) -> None:
    with contextlib.suppress(NetnsError):
        link.inside("tc", "qdisc", "del", "dev", link.ns_dev, "root")
