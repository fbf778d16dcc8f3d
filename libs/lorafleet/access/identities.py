"""nkey identities: one per node, per service and per client, kept as seed files.

A directory holds one seed file per identity, `<dir>/<kind>/<name>.nk`
(kind: node, service, client), mode 0600 in a 0700 directory. `ensure`
creates only the seeds that are missing: adding a node later writes one
new file and changes no other identity. The server config
(`server_config`) holds public keys only; each process runs with its own
seed file (`LORAFLEET_NATS_NKEY_SEED`, see `process_env`).

What it costs: a seed is 58 bytes; nats-py signs the server's nonce with
it once per connect (Ed25519, microseconds).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import nkeys

from lorafleet.access.permissions import (
    SERVICES,
    Permissions,
    PermissionsError,
    identity_block,
    identity_inbox_prefix,
)
from lorafleet.names import Names, check_token
from lorafleet.nats.config import ServerTls, authorization_block, nkey_server_config

#: The kinds of identity, in the order a config lists them.
KINDS = ("service", "client", "node")
#: The client identity `ensure_fleet` makes when none is named.
DEFAULT_CLIENT = "cli"
#: A seed file's name ends so.
SEED_SUFFIX = ".nk"


class IdentityError(PermissionsError):
    """A seed directory or file lorafleet cannot use; says what to change."""


@dataclass(frozen=True, slots=True)
class Identity:
    """One identity: its kind and name, its seed file and its public key."""

    kind: str
    name: str
    seed_file: Path
    public_key: str

    @property
    def label(self) -> str:
        """`<kind>/<name>`, as the config's comments and the CLI say it."""
        return f"{self.kind}/{self.name}"

    @property
    def inbox_prefix(self) -> str:
        return identity_inbox_prefix(self.kind, self.name)


def _check(kind: str, name: str) -> None:
    if kind not in KINDS:
        raise IdentityError(f"identity kind {kind!r}: use one of {', '.join(KINDS)}")
    check_token(name, f"{kind} name")
    if kind == "service" and name not in SERVICES:
        raise IdentityError(f"service {name!r}: use one of {', '.join(SERVICES)}")


def public_key_of(seed_file: Path) -> str:
    """The public key (`U...`) of the user seed in `seed_file`."""
    try:
        seed = seed_file.read_bytes().strip()
        return str(nkeys.from_seed(bytearray(seed)).public_key.decode())
    except OSError as e:
        raise IdentityError(f"cannot read the seed {seed_file}: {e.strerror}") from None
    except (nkeys.NkeysError, ValueError, TypeError):
        raise IdentityError(
            f"{seed_file} does not hold an nkey user seed (SU...): delete it and re-run "
            "`lorafleet auth` to make a new one (its old public key stops working)"
        ) from None


def _write_seed(path: Path) -> None:
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    # O_EXCL: an existing seed is never overwritten; 0600 from the first byte.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(bytes(seed) + b"\n")


class IdentityStore:
    """The seed files of one installation, under `root`."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def seed_path(self, kind: str, name: str) -> Path:
        _check(kind, name)
        return self.root / kind / f"{name}{SEED_SUFFIX}"

    def _mkdir(self, path: Path) -> None:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)

    def load(self, kind: str, name: str) -> Identity:
        """The identity whose seed exists; refuses a seed others can read."""
        path = self.seed_path(kind, name)
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            raise IdentityError(
                f"the seed {path} is readable by others (mode {mode:04o}): "
                f"`chmod 600 {path}`, and make a new one if others may have read it"
            )
        return Identity(kind, name, path, public_key_of(path))

    def ensure(self, kind: str, name: str) -> tuple[Identity, bool]:
        """The identity, its seed made if missing; True when it was made now."""
        path = self.seed_path(kind, name)
        made = False
        if not path.exists():
            self._mkdir(self.root)
            self._mkdir(path.parent)
            try:
                _write_seed(path)
                made = True
            except FileExistsError:  # a concurrent run made it: use that one
                pass
        return self.load(kind, name), made

    def names_of(self, kind: str) -> list[str]:
        """The names with a seed of `kind`, sorted."""
        folder = self.root / kind
        if not folder.is_dir():
            return []
        return sorted(p.name.removesuffix(SEED_SUFFIX) for p in folder.glob(f"*{SEED_SUFFIX}"))

    def all(self) -> list[Identity]:
        """Every identity with a seed, services first, then clients, then nodes."""
        return [self.load(kind, name) for kind in KINDS for name in self.names_of(kind)]


def ensure_fleet(
    store: IdentityStore, nodes: Iterable[str] = (), clients: Iterable[str] = ()
) -> tuple[list[Identity], list[Identity]]:
    """Every service's identity, `DEFAULT_CLIENT` (unless others are named),
    and those of `nodes` and `clients`, made where missing. Returns (every
    identity in the store, the ones made now)."""
    wanted = [("service", s) for s in SERVICES]
    named_clients = list(clients)
    if not named_clients and not store.names_of("client"):
        named_clients = [DEFAULT_CLIENT]
    wanted += [("client", c) for c in named_clients] + [("node", n) for n in nodes]
    for _kind, name in wanted:
        check_token(name, "identity name")
    made = [ident for ident, new in (store.ensure(k, n) for k, n in wanted) if new]
    return store.all(), made


def server_config(
    names: Names,
    identities: Iterable[Identity],
    *,
    listen: str | None = None,
    store_dir: str | None = None,
    max_payload: int | None = None,
    tls: ServerTls | None = None,
) -> str:
    """A nats-server config with one nkey user per identity, each with its block."""
    return nkey_server_config(
        _entries(names, identities),
        listen=listen,
        store_dir=store_dir,
        max_payload=max_payload,
        tls=tls,
    )


def authorization_config(names: Names, identities: Iterable[Identity]) -> str:
    """The `authorization` block alone, for a server config of one's own to
    `include` (compose/nats-cluster/nats.conf does)."""
    return authorization_block(_entries(names, identities))


def _entries(names: Names, identities: Iterable[Identity]) -> dict[str, tuple[str, Permissions]]:
    return {i.label: (i.public_key, identity_block(names, i.kind, i.name)) for i in identities}


@dataclass(frozen=True, slots=True)
class ClientTls:
    """A process's TLS files (PEM paths): the CA, and its certificate and key
    when the server verifies clients."""

    ca: str
    cert: str | None = None
    key: str | None = None


def process_env(identity: Identity, url: str, tls: ClientTls | None = None) -> dict[str, str]:
    """The LORAFLEET_* settings a process of `identity` runs with."""
    env = {
        "LORAFLEET_NATS_URL": url,
        "LORAFLEET_NATS_NKEY_SEED": str(identity.seed_file.resolve()),
        "LORAFLEET_NATS_INBOX_PREFIX": identity.inbox_prefix,
    }
    if identity.kind == "node":
        env["LORAFLEET_AGENT_NODE"] = identity.name
    if tls is not None:
        env["LORAFLEET_NATS_TLS_CA"] = tls.ca
        if tls.cert and tls.key:
            env["LORAFLEET_NATS_TLS_CERT"] = tls.cert
            env["LORAFLEET_NATS_TLS_KEY"] = tls.key
    return env
