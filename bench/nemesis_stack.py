"""The nemesis's fleet: every process of lorafleet this machine holds, made of
the tests' own stack code, and the faults that can be done to it.

`fleet(root, ...)` yields a `Fleet`: a three-server NATS cluster (R3,
`sync_interval: always`; lorafleet.nats.cluster), a PostgreSQL of the run's
own (initdb + pg_ctl on a free port, as the `postgres` user, when the
binaries are here; else a throwaway database on the shared server, never
restarted), two recorders, two schedulers, the artifact-store
(tests/system/conftest.py's `running_stack`, plus one of each more) and
three agents with the stand-in trainer. As root with `ip netns`, each agent
runs in a network namespace of its own (tests/partition/netns.py) and the
cluster listens on the host end of a fourth, "hub" link; each agent's
namespace has one route, to the hub's address, through its own veth pair.
Nothing listens beyond 127.0.0.0/8 and those pairs. Everything is removed
on the way out: processes, namespaces, the PostgreSQL cluster and its files.

`Fleet.kinds()` names the faults this machine allows and `Fleet.skipped`
says why the others are not done.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.*
from tests import disks
from tests.partition.helpers import agent_in
from tests.partition.netns import NetnsError, NetnsLink, available
from tests.pg import PrivatePostgres, throwaway_database
from tests.system.conftest import Stack, running_stack, system_settings

from lorafleet.names import Names
from lorafleet.nats.cluster import NatsCluster
from lorafleet_services.stack import ServiceProcess

#: The agents' node names.
NODES = ("node-1", "node-2", "node-3")
#: Seconds per stand-in step (each job says how many steps: max_steps).
STEP_S = 0.1
#: The recorder's ack wait on the cluster (tests/cluster/helpers.py's reasoning).
RECORDER_ACK_WAIT_S = 5.0
#: What a degraded link carries at most (tc tbf: there is no sch_netem here).
DEGRADED_KBIT_S = 256
#: MiB of each member's object-store filesystem (the run's artifacts are 64 KiB).
OBJECTS_DISK_MIB = 64


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
        if self.links:
            kinds += ["link.cut", "link.degrade"]
        if self.object_disks:
            kinds.append("disk.full")
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
        return None
    return PrivatePostgres()


@contextlib.asynccontextmanager
async def fleet(root: Path, orphan_age_s: float) -> AsyncIterator[Fleet]:
    """The whole fleet under `root` (see the module docstring); removed after."""
    skipped: dict[str, str] = {}
    links = _links(skipped)
    pg = _postgres(skipped)
    try:
        db_url = pg.start() if pg is not None else None
        host = links["hub"].host_ip if links else "127.0.0.1"
        cluster = NatsCluster(root / "cluster", host=host)
        with contextlib.ExitStack() as mounts:
            object_disks = _object_disks(cluster, mounts, skipped)
            async with cluster, _made(cluster, root, db_url, orphan_age_s) as stack:
                made = Fleet(stack, cluster, pg, links, skipped, [stack.recorder], object_disks)
                await _more_services(made)
                yield made
    finally:
        if pg is not None:
            await asyncio.to_thread(pg.remove)
        for link in links.values():
            link.delete()


def _object_disks(
    cluster: NatsCluster, mounts: contextlib.ExitStack, skipped: dict[str, str]
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
                disks.objects_dir(cluster.servers[name].store_dir, names), OBJECTS_DISK_MIB
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
        )
        first = cluster.servers[cluster.names[0]]
        async with running_stack(settings, first, root, "nemesis") as stack:
            yield stack


async def _more_services(made: Fleet) -> None:
    """The second recorder and scheduler, the model, and the three agents."""
    stack = made.stack
    second = ServiceProcess("lorafleet_services.recorder", stack.settings)
    stack.procs.append(second)
    made.recorders.append(await second.start())
    await stack.scheduler()
    await stack.add_model()
    env = {"LORAFLEET_STANDIN_STEP_S": str(STEP_S)}
    for node in NODES:
        if made.links:
            await agent_in(stack, made.links[node], node, env)
        else:
            await stack.agent(node, env)


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
