"""What the node should serve, and the choices serving makes: plain functions,
tested without a bus or an engine.

`DesiredSet` (which adapter versions each engine should hold, in
`<work_dir>/served/desired.json`, written atomically), `eviction_choice`
(the least recently served of the agent's own; one an operator loaded, or
the control plane placed, is never taken), `ReportSeq` (ServingReport.seq, growing per node across
restarts without being stored) and `ReloadBackoff` (when a failed reload may
be tried again). docs/fine-tune-and-serve.md says what each means to an operator.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import msgspec

DESIRED_FILE = "desired.json"


class DesiredAdapter(msgspec.Struct, kw_only=True):
    """One adapter version an engine should hold."""

    job_id: str
    served_name: str
    sha256: str
    #: The catalog model's name (reports carry it).
    model: str
    #: What the engine must serve for it to match (ModelRecord local_dir or hf_repo).
    base_model: str
    model_type: str | None = None
    #: The base the PEFT probe loads (a directory or a hub id).
    probe_base: str
    #: The staged copy the engine reads (`<work_dir>/served/<name>/`).
    path: str
    #: time.time() when it was last confirmed served (eviction takes the oldest).
    served_at: float = 0.0
    #: Placed here by the control plane's serving policy (NodeServeRequest.placed):
    #: never evicted (the control plane moves it; it may be the last replica).
    placed: bool = False


class _DesiredFile(msgspec.Struct):
    engines: dict[str, list[DesiredAdapter]] = msgspec.field(default_factory=dict)


class DesiredSetError(Exception):
    """desired.json cannot be read; the message says which file and why."""


@dataclass
class DesiredSet:
    """Engine url -> the adapters it should hold, saved on every change."""

    path: Path
    engines: dict[str, list[DesiredAdapter]]

    @classmethod
    def load(cls, path: Path) -> DesiredSet:
        """The saved set, or an empty one when there is no file yet."""
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return cls(path, {})
        try:
            saved = msgspec.json.decode(data, type=_DesiredFile)
        except msgspec.DecodeError as e:
            raise DesiredSetError(
                f"{path} is not a desired set ({e}): move it away and serve the adapters again"
            ) from None
        return cls(path, saved.engines)

    def _commit(self, engine: str, entries: list[DesiredAdapter]) -> None:
        """Write the set with `engine` holding `entries`, then hold it here:
        a write that fails changes nothing, on disk or in memory."""
        engines = {**self.engines, engine: entries}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with tmp.open("wb") as f:
            f.write(msgspec.json.encode(_DesiredFile({k: v for k, v in engines.items() if v})))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self.engines = engines

    def on(self, engine: str) -> list[DesiredAdapter]:
        return list(self.engines.get(engine, ()))

    def get(self, engine: str, served_name: str) -> DesiredAdapter | None:
        return next((a for a in self.on(engine) if a.served_name == served_name), None)

    def add(self, engine: str, adapter: DesiredAdapter) -> None:
        """Hold `adapter` on `engine` (replacing an entry of the same name)."""
        kept = [a for a in self.on(engine) if a.served_name != adapter.served_name]
        self._commit(engine, [*kept, adapter])

    def remove(self, engine: str, served_name: str) -> DesiredAdapter | None:
        gone = self.get(engine, served_name)
        if gone is not None:
            self._commit(engine, [a for a in self.on(engine) if a is not gone])
        return gone

    def of_job(self, job_id: str, engine: str | None = None) -> list[tuple[str, DesiredAdapter]]:
        """(engine, adapter) for every version of `job_id` held (on `engine` only, when given)."""
        return [
            (url, a)
            for url, entries in self.engines.items()
            if engine is None or url == engine
            for a in entries
            if a.job_id == job_id
        ]

    def paths_in_use(self) -> set[str]:
        return {a.path for entries in self.engines.values() for a in entries}

    def drop_unused(self, path: Path | None) -> None:
        """Remove a staged copy no engine should hold."""
        if path is not None and str(path) not in self.paths_in_use():
            shutil.rmtree(path, ignore_errors=True)


def eviction_choice(
    desired: Iterable[DesiredAdapter], loaded: Iterable[str], slots: int | None, incoming: str
) -> str | None:
    """The adapter to unload so that `incoming` fits, or None when no
    eviction is needed or none is possible.

    Needed when `incoming` is not loaded and `slots` (--max-cpu-loras) are
    all taken. Possible among the loaded adapters the agent put there
    (`desired`): the least recently served (lowest served_at) goes; one the
    control plane placed never does (it may be the fleet's last replica).
    """
    loaded_now = list(loaded)
    if slots is None or incoming in loaded_now or len(loaded_now) < slots:
        return None
    ours = [
        a
        for a in desired
        if a.served_name in loaded_now and a.served_name != incoming and not a.placed
    ]
    if not ours:
        return None
    return min(ours, key=lambda a: (a.served_at, a.served_name)).served_name


def needs_reload(
    desired: Iterable[DesiredAdapter],
    loaded: Iterable[str],
    pid_before: int | None,
    pid_now: int | None,
) -> list[DesiredAdapter]:
    """What to load again into an engine: everything desired when its process
    changed (a restart loses what was loaded at runtime), else what its
    /v1/models lacks."""
    wanted = list(desired)
    if pid_before is not None and pid_now is not None and pid_before != pid_now:
        return wanted
    have = set(loaded)
    return [a for a in wanted if a.served_name not in have]


class ReloadBackoff:
    """When a failed reload of one adapter into one engine is tried again:
    `first_s` after the first failure, doubling up to `max_s`; a load that
    succeeds forgets it. Without it an engine that keeps refusing an adapter
    it lost gets a load, a probe and a `failed` report every refresh."""

    def __init__(
        self, first_s: float, max_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.first_s = first_s
        self.max_s = max_s
        self._clock = clock
        #: key -> (the delay after its last failure, when it is due again)
        self._failed: dict[tuple[str, str], tuple[float, float]] = {}

    def due(self, key: tuple[str, str]) -> bool:
        held = self._failed.get(key)
        return held is None or self._clock() >= held[1]

    def failed(self, key: tuple[str, str]) -> float:
        """Record a failure; answers the seconds until the next try."""
        held = self._failed.get(key)
        delay_s = self.first_s if held is None else min(self.max_s, 2 * held[0])
        self._failed[key] = (delay_s, self._clock() + delay_s)
        return delay_s

    def succeeded(self, key: tuple[str, str]) -> None:
        self._failed.pop(key, None)


class ReportSeq:
    """ServingReport.seq for one node (see the module doc)."""

    def __init__(self, clock_us: Callable[[], int] | None = None) -> None:
        self._clock_us = clock_us or (lambda: time.time_ns() // 1000)
        self.last = 0

    def next(self) -> int:
        self.last = max(self.last + 1, self._clock_us())
        return self.last


def remove_stale_copies(served_dir: Path, in_use: set[str]) -> list[str]:
    """Staged copies under `served_dir` that no engine should hold: removed
    (an agent killed between unload and removal left them). Answers their names."""
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for child in served_dir.iterdir():
            if child.is_dir() and str(child) not in in_use:
                shutil.rmtree(child, ignore_errors=True)
                removed.append(child.name)
    return removed
