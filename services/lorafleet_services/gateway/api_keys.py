"""The gateway's API keys: made by `lorafleet auth api-key create NAME`,
shown once, kept hashed in one JSON file the gateway reads; listed by
`api-key list`, revoked by `api-key revoke NAME`.

A key is `lf-<43 url-safe characters>` (256 random bits); the file holds
`{"keys": [{"name": ..., "project": ..., "sha256": ..., "created_at": ...}]}`,
mode 0600, so it holds no secret (a sha256 of 256 random bits cannot be
walked back) and may be copied to the gateway's host as the nkey server
config is. Each key belongs to a project (`--project`): the files, jobs and
fine-tuned models made with any key of a project are the project's, shared
by its keys (tenancy.py). A key without a project (every key made before
projects existed) is its own project, named as the key: its files and jobs
stay where they were, and a new key made `--project <that name>` shares them.

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


class KeysFileError(ApiKeysError):
    """The keys file is not one lorafleet wrote (malformed)."""


class StoredKey(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str
    sha256: str
    created_at: dt.datetime
    #: The project the key belongs to; None: its own (named as the key).
    project: str | None = None

    @property
    def project_name(self) -> str:
        return self.project or self.name


@dataclass(frozen=True, slots=True)
class Caller:
    """Who a request comes from: the key's name and its project."""

    key: str
    project: str


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
    except msgspec.DecodeError as e:  # malformed JSON, or not our shape (ValidationError)
        raise KeysFileError(f"{path} is not a lorafleet API keys file ({e}): remake it") from None


def make_key(
    path: Path, name: str, project: str | None = None, now: dt.datetime | None = None
) -> str:
    """A new key `name` of `project` (None: its own project), its hash added
    to `path`; returns the key (the only time it is seen). A name that has a
    key already is an ApiKeysError: revoke it first to replace it."""
    check_token(name, "API key name")
    if project is not None:
        check_token(project, "project name")
    stored = read_keys(path)
    if any(k.name == name for k in stored.keys):
        raise ApiKeysError(
            f"{name!r} has an API key already: pick another name, or revoke it "
            f"(`lorafleet auth api-key revoke {name}`) to make a new one"
        )
    _check_project(path, stored, name, project)
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    made = StoredKey(
        name=name, sha256=key_digest(key), created_at=now or dt.datetime.now(dt.UTC),
        project=project,
    )  # fmt: skip
    stored.keys.append(made)
    _write_keys(path, stored)
    return key


def _check_project(path: Path, stored: KeysFile, name: str, project: str | None) -> None:
    """A key's own project is named as the key, so the two namespaces meet:
    refuse a name that would join or split a project by accident."""
    projects = {k.project_name for k in stored.keys}
    if project is None and name in projects:
        raise ApiKeysError(
            f"{name!r} is a project in {path}: a key named so without --project would "
            f"share its files, jobs and models; give --project {name} to mean that, or "
            "another name"
        )
    owners = [k for k in stored.keys if k.name == project and k.project_name != project]
    if owners:
        raise ApiKeysError(
            f"{project!r} is the name of a key of project {owners[0].project_name!r}: "
            "pick another project name"
        )


def revoke_key(path: Path, name: str) -> StoredKey:
    """Take key `name` out of `path` (a gateway refuses it at once: 401);
    returns what was stored. ApiKeysError when there is no such key."""
    stored = read_keys(path)
    found = [k for k in stored.keys if k.name == name]
    if not found:
        have = ", ".join(k.name for k in stored.keys) or "none"
        raise ApiKeysError(f"no API key {name!r} in {path} (its keys: {have})")
    stored.keys = [k for k in stored.keys if k.name != name]
    _write_keys(path, stored)
    return found[0]


def _write_keys(path: Path, stored: KeysFile) -> None:
    """Replace `path` whole (a gateway reading it sees the old or the new, never half)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(msgspec.json.format(msgspec.json.encode(stored)))
    tmp.replace(path)


@dataclass
class KeyRing:
    """The keys of one file, re-read when the file changes."""

    path: Path
    _seen: tuple[int, int] | None = None
    _by_digest: dict[str, Caller] | None = None

    def caller_of(self, key: str) -> Caller | None:
        """Whose `key` is (its name and project); None for no such key."""
        # Looked up by its digest: a caller cannot steer the digest, so how
        # long the lookup takes says nothing about any stored key.
        return self._current().get(key_digest(key))

    def _current(self) -> dict[str, Caller]:
        try:
            st = self.path.stat()
            seen: tuple[int, int] | None = (st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            seen = None
        if self._by_digest is None or seen != self._seen:
            self._by_digest = {
                k.sha256: Caller(k.name, k.project_name) for k in read_keys(self.path).keys
            }
            self._seen = seen
        return self._by_digest
