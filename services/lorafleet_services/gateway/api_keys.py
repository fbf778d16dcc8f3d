"""The gateway's API keys: made by `lorafleet auth api-key NAME`, shown once,
kept hashed in one JSON file the gateway reads.

A key is `lf-<43 url-safe characters>` (256 random bits); the file holds
`{"keys": [{"name": ..., "sha256": ..., "created_at": ...}]}`, mode 0600, so
it holds no secret (a sha256 of 256 random bits cannot be walked back) and
may be copied to the gateway's host as the nkey server config is. Each key
is one client: its name owns the files and jobs made with it.

The gateway re-reads the file when its modification time or size changes
(a stat per request, microseconds): a key made while it runs works at once,
and a key removed from the file stops working at once.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import msgspec

from lorafleet.names import check_token

#: What every key starts with (so a leaked one is recognisable in logs and scans).
KEY_PREFIX = "lf-"


class ApiKeysError(ValueError):
    """An API keys file or key name lorafleet cannot use; says what to change."""


class StoredKey(msgspec.Struct, kw_only=True):
    name: str
    sha256: str
    created_at: dt.datetime


class KeysFile(msgspec.Struct, kw_only=True):
    keys: list[StoredKey] = msgspec.field(default_factory=list)


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def read_keys(path: Path) -> KeysFile:
    """The file's keys; none when it does not exist."""
    try:
        return msgspec.json.decode(path.read_bytes(), type=KeysFile)
    except FileNotFoundError:
        return KeysFile()
    except msgspec.ValidationError as e:
        raise ApiKeysError(f"{path} is not a lorafleet API keys file ({e}): remake it") from None


def make_key(path: Path, name: str, now: dt.datetime | None = None) -> str:
    """A new key for client `name`, its hash added to `path`; returns the key
    (the only time it is seen). A name that has a key already is a
    ApiKeysError: remove its line from the file first to replace it."""
    check_token(name, "API key name")
    stored = read_keys(path)
    if any(k.name == name for k in stored.keys):
        raise ApiKeysError(
            f"{name!r} has an API key already: pick another name, or delete its entry "
            f"from {path} to make a new one"
        )
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    stored.keys.append(
        StoredKey(name=name, sha256=key_digest(key), created_at=now or dt.datetime.now(dt.UTC))
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(msgspec.json.format(msgspec.json.encode(stored)))
    tmp.replace(path)
    return key


@dataclass
class KeyRing:
    """The keys of one file, re-read when the file changes."""

    path: Path
    _seen: tuple[int, int] | None = None
    _by_digest: dict[str, str] | None = None

    def client_of(self, key: str) -> str | None:
        """The name of the client `key` belongs to; None for no such key."""
        # Looked up by its digest: a caller cannot steer the digest, so how
        # long the lookup takes says nothing about any stored key.
        return self._current().get(key_digest(key))

    def _current(self) -> dict[str, str]:
        try:
            st = self.path.stat()
            seen: tuple[int, int] | None = (st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            seen = None
        if self._by_digest is None or seen != self._seen:
            self._by_digest = {k.sha256: k.name for k in read_keys(self.path).keys}
            self._seen = seen
        return self._by_digest
