"""A NATS cluster of embedded nats-servers on one host (tests, benches, trials).

Three `NatsServer`s, each with its own client, route and monitoring port
(chosen once and kept across restarts) and store, run from one config that
reads what differs from the environment (compose/nats-cluster/nats.conf's
contract), with JetStream's `sync_interval: always`: with the default lazy
fsync an acknowledged write can be lost on power failure (Jepsen's 2025
analysis of NATS). Ready means JetStream's meta group has a leader that
sees every peer current, so a stream made at R3 at once gets its replicas.
The fault tests' helpers: `meta_leader()`, `stream_leader()`,
`member_of_url()`, `kill()`, `restart()`, and `isolate()`/`rejoin()` (a
member's routes reloaded away while its clients stay on it). More:
libs/lorafleet/DESIGN.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import secrets
import signal
import socket
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nats.js import JetStreamContext

from lorafleet.nats.server import NatsServer, NatsServerError, binary
from lorafleet.polling import poll_until

#: Seconds to wait for the meta leader and every peer to be current.
CLUSTER_READY_TIMEOUT_S = 30.0
#: Seconds between polls of the monitoring endpoints while waiting.
POLL_S = 0.1
#: Seconds one monitoring request may take.
MONITOR_TIMEOUT_S = 1.0
#: Members of the cluster (the config routes each to the other two).
CLUSTER_SIZE = 3


@dataclass(frozen=True, slots=True)
class MemberPorts:
    client: int
    cluster: int
    monitor: int


#: The members' config when none is given: the contract of
#: compose/nats-cluster/nats.conf (what differs between members comes from
#: the environment), without its comments.
DEFAULT_CONFIG = """
server_name: $NATS_SERVER_NAME
listen: $NATS_CLIENT_LISTEN
client_advertise: $NATS_CLIENT_ADVERTISE
http: $NATS_HTTP_LISTEN
jetstream {
  store_dir: $NATS_STORE_DIR
  sync_interval: always
}
lame_duck_grace_period: 2s
lame_duck_duration: 30s
cluster {
  name: lorafleet
  listen: $NATS_CLUSTER_LISTEN
  routes: [
    $NATS_ROUTE_A
    $NATS_ROUTE_B
  ]
}
"""


def member_env(
    name: str, host: str, ports: MemberPorts, store_dir: Path | str, routes: list[str]
) -> dict[str, str]:
    """The environment one member's config reads (see DEFAULT_CONFIG): its
    name, listen addresses (the client one also advertised to clients),
    store and the routes to the other two."""
    if len(routes) != 2:
        raise ValueError("the cluster config routes to exactly two other members")
    return {
        "NATS_SERVER_NAME": name,
        "NATS_CLIENT_LISTEN": f"{host}:{ports.client}",
        "NATS_CLIENT_ADVERTISE": f"{host}:{ports.client}",
        "NATS_CLUSTER_LISTEN": f"{host}:{ports.cluster}",
        "NATS_HTTP_LISTEN": f"{host}:{ports.monitor}",
        "NATS_STORE_DIR": str(store_dir),
        "NATS_ROUTE_A": routes[0],
        "NATS_ROUTE_B": routes[1],
    }


class _Member(NatsServer):
    """A member runs from its config alone (listen, JetStream, store, routes)."""

    def _args(self) -> list[str]:
        return [binary(), "-c", str(self.config_file)]


#: free_ports' ports lie below the kernel's ephemeral range (which every
#: `bind(0)` and nats-server `-p -1` draws from), from here up.
RESERVED_PORTS_LOW = 10000
#: Ports in a process's block: each process that asks takes a block of its own.
PORT_BLOCK = 200
#: Where the blocks' lock files are (one `flock` each, held for the process's life).
PORT_LOCKS = Path(tempfile.gettempdir()) / "lorafleet-ports"


class _PortBlock:
    """This process's block of ports, handed out in turn; None until first asked."""

    block: tuple[int, int] | None = None
    lock_fd: int | None = None
    next_index = 0


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; elsewhere a guess below IANA's 49152


def _take_block() -> tuple[int, int]:
    """Lock a block no other process holds (a run's workers, another run): its range."""
    if _PortBlock.block is not None:
        return _PortBlock.block
    PORT_LOCKS.mkdir(parents=True, exist_ok=True)
    starts = list(range(RESERVED_PORTS_LOW, _ephemeral_low() - PORT_BLOCK + 1, PORT_BLOCK))
    if not starts:
        raise NatsServerError(
            f"the ephemeral port range starts at {_ephemeral_low()}, too low for a block of "
            f"{PORT_BLOCK} ports above {RESERVED_PORTS_LOW} (net.ipv4.ip_local_port_range)"
        )
    first = secrets.randbelow(len(starts))
    for start in starts[first:] + starts[:first]:
        fd = os.open(PORT_LOCKS / f"{start}.lock", os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        _PortBlock.block, _PortBlock.lock_fd = (start, start + PORT_BLOCK), fd
        return _PortBlock.block
    raise NatsServerError(
        f"every block of {PORT_BLOCK} ports from {RESERVED_PORTS_LOW} is held by another "
        f"process (lock files in {PORT_LOCKS})"
    )


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports free right now, for servers that cannot pick
    their own and report it (a cluster's routes name each other's ports).

    They come from a block of ports this process alone holds (a lock file),
    below the ephemeral range: no other process that asks here, and no
    port 0 anywhere, can be given one of them, so a port stays this
    process's across a server's restart. Within the block they go round in
    turn, skipping any that something listens on; a whole round without
    `count` of them is an error, not a loop."""
    start, end = _take_block()
    found: list[int] = []
    for _ in range(end - start):
        port = start + _PortBlock.next_index
        _PortBlock.next_index = (_PortBlock.next_index + 1) % (end - start)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        found.append(port)
        if len(found) == count:
            return found
    raise NatsServerError(f"fewer than {count} free ports in this process's block {start}-{end}")


class NatsCluster:
    """Three nats-servers on `host`, routed to each other, JetStream on.

    root: a directory for the config and the members' stores (`<root>/<name>/`).
    config_file: the members' config, reading what differs between them from
        the environment (`member_env`); default: DEFAULT_CONFIG, written
        for each member with its environment filled in (`<root>/<name>.conf`,
        which `isolate` rewrites). compose/nats-cluster/nats.conf is one.
    Members are named nats-1, nats-2, nats-3 (as in compose).
    """

    def __init__(
        self, root: str | Path, host: str = "127.0.0.1", config_file: str | Path | None = None
    ) -> None:
        size = CLUSTER_SIZE
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.host = host
        #: The members' shared config; None: DEFAULT_CONFIG, a file per member
        #: (its routes can be changed and reloaded: `isolate`).
        self.config_file = Path(config_file) if config_file is not None else None
        self.isolated: set[str] = set()
        self.names = [f"nats-{i + 1}" for i in range(size)]
        flat = free_ports(3 * size, host)
        self.ports = {
            n: MemberPorts(flat[3 * i], flat[3 * i + 1], flat[3 * i + 2])
            for i, n in enumerate(self.names)
        }
        self.servers: dict[str, NatsServer] = {}
        for name in self.names:
            self.servers[name] = self._member(name)

    def _routes(self, name: str) -> list[str]:
        return [
            f"nats-route://{self.host}:{self.ports[other].cluster}"
            for other in self.names
            if other != name
        ]

    def _member(self, name: str) -> NatsServer:
        ports = self.ports[name]
        store = self.root / name / "store"
        env = member_env(name, self.host, ports, store, self._routes(name))
        config = self.config_file
        if config is None:
            config = self._write_config(name, env)
        return _Member(
            store,
            port=ports.client,
            host=self.host,
            config_file=config,
            monitor_port=ports.monitor,
            env=env,
        )

    def _write_config(self, name: str, env: dict[str, str]) -> Path:
        """`name`'s file: the default config with `env` written in, minus the
        routes to and from isolated members."""
        text = DEFAULT_CONFIG
        peers = [n for n in self.names if n != name]  # in _routes' order
        for var, peer in zip(("NATS_ROUTE_A", "NATS_ROUTE_B"), peers, strict=True):
            if name in self.isolated or peer in self.isolated:
                text = text.replace(f"${var}", "")
        if name in self.isolated:
            # Removing routes alone can race: a peer that reloaded first may
            # hear of this member from the third (gossip) and connect to it
            # as an implicit route, which no reload removes. A password no
            # peer knows refuses those, and the reload closes any accepted.
            listen = "  listen: $NATS_CLUSTER_LISTEN\n"
            cut = f"  authorization {{ user: isolated, password: {secrets.token_hex(8)} }}\n"
            text = text.replace(listen, listen + cut)
        for var, value in env.items():
            text = text.replace(f"${var}", value)
        path = self.root / f"{name}.conf"
        path.write_text(text)
        return path

    # --- addresses --------------------------------------------------------

    @property
    def url(self) -> str:
        """Every member's client URL, comma separated (what LORAFLEET_NATS_URL takes)."""
        return ",".join(self.servers[n].url for n in self.names)

    def urls(self, members: list[str] | None = None) -> list[str]:
        return [self.servers[n].url for n in members or self.names]

    def member_of_url(self, url: str) -> str:
        """The member whose client port `url` names (e.g. a client's connected_url)."""
        for name, ports in self.ports.items():
            if url.rstrip("/").endswith(f":{ports.client}"):
                return name
        raise KeyError(f"no member of this cluster listens at {url}")

    def running(self) -> list[str]:
        return [n for n in self.names if self.servers[n].proc is not None]

    # --- lifecycle --------------------------------------------------------

    async def start(self) -> NatsCluster:
        try:
            await asyncio.gather(*(s.start() for s in self.servers.values()))
            await self.wait_ready()
        except BaseException:
            await self.stop()
            raise
        return self

    async def stop(self) -> None:
        await asyncio.gather(*(s.stop() for s in self.servers.values()))

    async def kill(self, name: str) -> None:
        """SIGKILL one member (its store stays; `restart` brings it back)."""
        await self.servers[name].stop(kill=True)

    async def restart(self, name: str, kill: bool = True, lame_duck: bool = False) -> None:
        """Stop (SIGKILL unless told otherwise; `lame_duck`: in lame-duck mode,
        an upgrade's way) and start again, on its ports and store; returns
        once it is current with the cluster again."""
        await self.servers[name].stop(kill=kill and not lame_duck, lame_duck=lame_duck)
        await self.servers[name].start()
        await self.wait_ready()

    async def isolate(self, name: str) -> None:
        """Cut `name` off from the other members (its clients stay connected):
        every member reloads its config without the routes to or from it;
        returns once its routes are gone."""
        await self._reroute(add=name)

        async def cut_off() -> bool:
            routez = await self.monitor(name, "/routez")
            return not routez.get("routes")

        if not await poll_until(cut_off, timeout_s=CLUSTER_READY_TIMEOUT_S, interval_s=POLL_S):
            raise NatsServerError(
                f"{name}'s routes did not go within {CLUSTER_READY_TIMEOUT_S:.0f} s"
            )

    async def rejoin(self, name: str) -> None:
        """Undo `isolate(name)`; returns once it is routed to every other
        running member and the cluster is ready again (the meta leader's
        view of its peers lags the routes, so readiness alone can pass
        before the member is back)."""
        await self._reroute(remove=name)
        others = {n for n in self.running() if n != name and n not in self.isolated}

        async def routed() -> bool:
            routez = await self.monitor(name, "/routez")
            return others <= {r.get("remote_name") for r in routez.get("routes") or []}

        if not await poll_until(routed, timeout_s=CLUSTER_READY_TIMEOUT_S, interval_s=POLL_S):
            raise NatsServerError(
                f"{name} was not routed to {sorted(others)} again "
                f"within {CLUSTER_READY_TIMEOUT_S:.0f} s"
            )
        await self.wait_ready()

    async def _reroute(self, add: str | None = None, remove: str | None = None) -> None:
        if self.config_file is not None:
            raise NatsServerError("isolate() needs the default config (a file per member)")
        if add:
            self.isolated.add(add)
        if remove:
            self.isolated.discard(remove)
        for name in self.names:
            member = self.servers[name]
            self._write_config(name, member.env)
            if member.proc is not None:
                member.proc.send_signal(signal.SIGHUP)

    async def __aenter__(self) -> NatsCluster:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # --- what the cluster says about itself -------------------------------

    async def monitor(self, name: str, path: str) -> dict[str, Any]:
        """GET `path` (e.g. "/jsz?streams=true") of one member's monitoring port."""
        url = f"http://{self.host}:{self.ports[name].monitor}{path}"

        def get() -> dict[str, Any]:
            try:
                with urllib.request.urlopen(url, timeout=MONITOR_TIMEOUT_S) as r:
                    body: dict[str, Any] = json.loads(r.read())
            except urllib.error.HTTPError as e:  # /healthz answers 503 with a body
                body = json.loads(e.read() or b"{}")
            return body

        return await asyncio.to_thread(get)

    async def meta_leader(self) -> str | None:
        """The JetStream meta leader as the running members see it (None: none now)."""
        for name in self.running():
            with contextlib.suppress(OSError, ValueError):
                meta = (await self.monitor(name, "/jsz")).get("meta_cluster") or {}
                if meta.get("leader"):
                    return str(meta["leader"])
        return None

    async def _ready_now(self) -> bool:
        running = self.running()
        for name in running:
            try:
                meta = (await self.monitor(name, "/jsz")).get("meta_cluster") or {}
                health = await self.monitor(name, "/healthz")
            except (OSError, ValueError):
                return False
            if not meta.get("leader") or health.get("status") != "ok":
                return False
            if meta.get("leader") == name:
                peers = meta.get("replicas") or []
                current = [p for p in peers if p.get("current") and p.get("name") in running]
                if len(current) < len(running) - 1:
                    return False
        return True

    async def wait_ready(self, timeout_s: float = CLUSTER_READY_TIMEOUT_S) -> None:
        """Until the running members have a meta leader, every one reports
        healthy (JetStream current) and the leader sees every peer current."""
        if not await poll_until(self._ready_now, timeout_s=timeout_s, interval_s=POLL_S):
            raise NatsServerError(
                f"the cluster ({', '.join(self.running())}) did not become ready "
                f"within {timeout_s:.0f} s: no meta leader, or a member not current"
            )


async def stream_leader(js: JetStreamContext, stream: str) -> str:
    """The member that leads `stream` now (`$JS.API.STREAM.INFO` cluster.leader)."""
    info = await js.stream_info(stream)
    leader = info.cluster.leader if info.cluster is not None else None
    if not leader:
        raise NatsServerError(f"stream {stream} has no leader right now")
    return leader
