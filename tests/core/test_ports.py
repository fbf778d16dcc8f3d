"""free_ports: a block of ports per process, which no other process that
asks (another test worker, another run) and no port-0 bind is given."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from lorafleet.nats import cluster as natscluster
from lorafleet.nats.cluster import PORT_BLOCK, NatsServerError, free_ports

#: Run in a child: take a block (the start index that `randbelow` gives is
#: forced to argv[1]), print its first port, and hold it until stdin closes.
HOLD = """
import sys
from lorafleet.nats import cluster as natscluster
natscluster.secrets.randbelow = lambda n: int(sys.argv[1])
print(natscluster.free_ports(1)[0], flush=True)
sys.stdin.read()
"""


def hold_block(start_index: int) -> tuple[subprocess.Popen[str], int]:
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(start_index)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert child.stdout is not None
    return child, int(child.stdout.readline())


def test_a_block_held_by_one_process_is_never_given_to_another() -> None:
    first, port = hold_block(5)
    try:
        # The second child starts its search at the very block the first holds.
        second, other = hold_block(5)
        try:
            assert abs(other - port) >= PORT_BLOCK, (port, other)
        finally:
            second.communicate("")
    finally:
        first.communicate("")


def test_ports_lie_below_the_ephemeral_range_and_are_free() -> None:
    ports = free_ports(5)
    assert len(set(ports)) == 5
    assert all(natscluster.RESERVED_PORTS_LOW <= p < natscluster._ephemeral_low() for p in ports)
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free: nothing listens there


def test_a_taken_port_is_skipped_and_a_full_block_is_an_error_not_a_wait() -> None:
    (busy,) = free_ports(1)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", busy))
        listener.listen()
        with pytest.raises(NatsServerError, match=r"fewer than .* free ports"):
            free_ports(PORT_BLOCK)  # a whole round of the block, one port taken
        handed = {free_ports(1)[0] for _ in range(PORT_BLOCK)}  # round and round
        assert busy not in handed
