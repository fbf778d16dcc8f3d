"""A network namespace joined to the test's side by one veth pair.

`NetnsLink` creates namespace `lf<token>` and a veth pair (`lfh<token>` on
the test's side with 10.231.<a>.<b>+1/30, `lfn<token>` inside with +2),
nothing else: no route, no bridge, no address outside that /30, so the only
traffic a test can cause is between the two veth ends. `cut()` takes the
inside end down (the test's side keeps its address, so servers listening on
it stay reachable for everyone else), `restore()` brings it back,
`degrade()` adds `tc netem` delay and loss on both ends; where the kernel
has no sch_netem, `drop()` loses packets with nftables inside the
namespace instead (both directions) and tests/partition/relay.py delays
them. `delete()` removes the namespace, which removes the pair (and the
namespace's nftables rules) with it.

Linux only, and root (or CAP_NET_ADMIN) only: `available()` says why not.
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess

#: Seconds one `ip`/`tc` command may take.
IP_TIMEOUT_S = 10.0
#: The /16 the links' /30s come from (RFC 1918; nothing else here uses it).
SUBNET_PREFIX = "10.231"


class NetnsError(RuntimeError):
    """An `ip` or `tc` command failed; the message has its output."""


def _run(*argv: str) -> str:
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NetnsError(f"{' '.join(argv)}: {e}") from e
    if done.returncode != 0:
        raise NetnsError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}")
    return done.stdout


class NetnsLink:
    """One namespace and the veth pair to it; `host_ip` is the test's end."""

    def __init__(self) -> None:
        token = secrets.token_hex(3)
        self.ns = f"lf{token}"
        self.host_dev, self.ns_dev = f"lfh{token}", f"lfn{token}"
        a, b = secrets.randbelow(256), secrets.randbelow(64) * 4
        self.host_ip = f"{SUBNET_PREFIX}.{a}.{b + 1}"
        self.ns_ip = f"{SUBNET_PREFIX}.{a}.{b + 2}"
        self.created = False

    def create(self) -> NetnsLink:
        try:
            _run("ip", "netns", "add", self.ns)
            self.created = True
            _run("ip", "link", "add", self.host_dev, "type", "veth", "peer", "name", self.ns_dev)
            _run("ip", "link", "set", self.ns_dev, "netns", self.ns)
            _run("ip", "addr", "add", f"{self.host_ip}/30", "dev", self.host_dev)
            _run("ip", "link", "set", self.host_dev, "up")
            self.inside("ip", "addr", "add", f"{self.ns_ip}/30", "dev", self.ns_dev)
            self.inside("ip", "link", "set", self.ns_dev, "up")
            self.inside("ip", "link", "set", "lo", "up")
        except NetnsError:
            self.delete()
            raise
        return self

    def inside(self, *argv: str) -> str:
        return _run("ip", "netns", "exec", self.ns, *argv)

    def cut(self) -> None:
        """Nothing passes between the two ends (connections stall, no reset)."""
        self.inside("ip", "link", "set", self.ns_dev, "down")

    def restore(self) -> None:
        self.inside("ip", "link", "set", self.ns_dev, "up")

    def degrade(self, delay_ms: int, loss_pct: float) -> None:
        """`tc netem` on both ends: each direction `delay_ms` late, `loss_pct` lost."""
        spec = ["netem", "delay", f"{delay_ms}ms", "loss", f"{loss_pct}%"]
        _run("tc", "qdisc", "add", "dev", self.host_dev, "root", *spec)
        self.inside("tc", "qdisc", "add", "dev", self.ns_dev, "root", *spec)

    def limit(self, kbit_s: int) -> None:
        """What leaves the namespace goes at most `kbit_s` kbit/s (`tc tbf`).

        Segments are kept to one MTU first: tbf drops every packet larger
        than its burst, and a veth hands it segments of up to 64 KiB."""
        self.inside("ip", "link", "set", "dev", self.ns_dev, "gso_max_size", "1500")
        self.inside(
            "tc", "qdisc", "add", "dev", self.ns_dev, "root",
            "tbf", "rate", f"{kbit_s}kbit", "burst", "8kb", "latency", "1s",
        )  # fmt: skip

    def drop(self, loss_pct: float) -> None:
        """Lose `loss_pct` of the packets each way, at random (nftables in the
        namespace: `numgen random`, one rule on input and one on output)."""
        table, per_10k = "lorafleet_loss", round(loss_pct * 100)
        self.inside("nft", "add", "table", "inet", table)
        for hook in ("input", "output"):
            self.inside(
                "nft", "add", "chain", "inet", table, hook,
                f"{{ type filter hook {hook} priority 0; }}",
            )  # fmt: skip
            self.inside(
                "nft", "add", "rule", "inet", table, hook,
                "numgen", "random", "mod", "10000", "<", str(per_10k), "counter", "drop",
            )  # fmt: skip

    def dropped(self) -> int:
        """Packets `drop()`'s rules have dropped so far, both ways."""
        out = self.inside("nft", "list", "table", "inet", "lorafleet_loss")
        return sum(int(m) for m in re.findall(r"counter packets (\d+)", out))

    def delete(self) -> None:
        """Remove the namespace (and with it both veth ends); safe to repeat."""
        if self.created:
            # The inside end goes with the namespace, its peer with it.
            subprocess.run(["ip", "netns", "del", self.ns], capture_output=True, check=False)
            self.created = False
        subprocess.run(["ip", "link", "del", self.host_dev], capture_output=True, check=False)


def join(a: NetnsLink, b: NetnsLink) -> None:
    """A veth pair straight between `a`'s and `b`'s namespaces (a /30 of its
    own) and a route each way to the other's `ns_ip` from its own: two
    namespaces reach each other at their own addresses, through no third
    (the deploy rehearsal's nodes and control plane). It goes with either
    namespace's `delete()`."""
    token = secrets.token_hex(3)
    dev_a, dev_b = f"lfa{token}", f"lfb{token}"
    c, d = secrets.randbelow(256), secrets.randbelow(64) * 4
    ip_a, ip_b = f"{SUBNET_PREFIX}.{c}.{d + 1}", f"{SUBNET_PREFIX}.{c}.{d + 2}"
    _run("ip", "link", "add", dev_a, "netns", a.ns, "type", "veth", "peer", "name", dev_b,
         "netns", b.ns)  # fmt: skip
    for link, dev, ip, other, via in ((a, dev_a, ip_a, b, ip_b), (b, dev_b, ip_b, a, ip_a)):
        link.inside("ip", "addr", "add", f"{ip}/30", "dev", dev)
        link.inside("ip", "link", "set", dev, "up")
        link.inside("ip", "route", "add", f"{other.ns_ip}/32", "via", via, "src", link.ns_ip)


def available() -> str | None:
    """Why this machine cannot run partition tests (None: it can)."""
    if not os.path.exists("/proc/self/ns/net"):
        return "no network namespaces here (not Linux)"
    link = NetnsLink()
    try:
        link.create()
    except NetnsError as e:
        return f"cannot create a network namespace and veth pair (root or CAP_NET_ADMIN): {e}"
    finally:
        link.delete()
    return None


def nft_available(link: NetnsLink) -> str | None:
    """Why nftables cannot drop packets in `link`'s namespace (None: it can)."""
    try:
        link.inside("nft", "list", "tables")
    except NetnsError as e:
        return f"nftables is not available (apt-get install nftables): {e}"
    return None


def netem_available(link: NetnsLink) -> str | None:
    """Why `tc netem` cannot be used on `link` (None: it can)."""
    try:
        _run("tc", "qdisc", "add", "dev", link.host_dev, "root", "netem", "delay", "1ms")
        _run("tc", "qdisc", "del", "dev", link.host_dev, "root")
    except NetnsError as e:
        return f"tc netem is not available (the kernel's sch_netem module): {e}"
    return None
