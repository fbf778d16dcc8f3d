"""Delivering the trainer's checkpoints while it trains.

`CheckpointSender.offer()` takes the trainer's checkpoint line without
waiting for anything (it is called from the line reader), and a task of its
own packs the directory (a tar, in a thread) and delivers it as kind
`checkpoint` with its step. One in flight, one slot for the newest: a newer
checkpoint replaces the one waiting there, which is removed unsent, so the
disk holds at most three. A checkpoint that cannot be delivered is logged
and skipped (the store keeps the one before); `stop()` at the end of
training drops what is in flight: the final adapter is what matters then.

`ask_checkpoint` asks the trainer for one after its next step (the
scheduler's, before it moves a drained node's job: trainer's side in
lorafleet_trainer.protocol.CheckpointAsks).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import time
from pathlib import Path
from typing import Any

from nats.js import JetStreamContext

import lorafleet_services.agent.transfer.delivery as delivery
import lorafleet_services.agent.transfer.packing as packing
from lorafleet._tasks import stop_tasks
from lorafleet.log import Event
from lorafleet.names import Names
from lorafleet_schemas.messages import ArtifactKind, TrainerCheckpoint


def inside(root: Path, path: str) -> Path | None:
    """The checkpoint directory `path` when it is a directory directly in
    `root` (links resolved), else None: the agent removes what it names, so
    it must not name anything else."""
    try:
        p = Path(path).resolve(strict=True)
    except (OSError, RuntimeError):
        return None
    if p.parent != root.resolve() or not p.is_dir():
        return None
    return p


#: The file in the job directory that asks the trainer for a checkpoint.
CHECKPOINT_NOW_FILE = "checkpoint-now"


def ask_checkpoint(path: Path) -> None:
    """A new token in `path` (through a temporary name: the trainer never
    reads half of it): one more checkpoint asked."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(f"{time.time_ns()}\n", encoding="utf-8")
    os.replace(tmp, path)


def remove_all(paths: list[Path]) -> None:
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)


class CheckpointSender:
    """The job's checkpoints, the newest delivered from a task of its own.

    logger: the job's (bound to node, job and attempt).
    """

    def __init__(
        self,
        js: JetStreamContext,
        names: Names,
        *,
        node: str,
        job_id: str,
        attempt: int,
        root: Path,
        chunk_bytes: int,
        logger: Any,
    ) -> None:
        self.js = js
        self.names = names
        self.node = node
        self.job_id = job_id
        self.attempt = attempt
        self.root = root
        self.chunk_bytes = chunk_bytes
        self.logger = logger
        #: The newest checkpoint not yet started; None when there is none.
        self.pending: tuple[TrainerCheckpoint, Path] | None = None
        self.in_flight: tuple[TrainerCheckpoint, Path] | None = None
        #: Checkpoint directories still on disk, by step.
        self._dirs: dict[int, Path] = {}
        self._wake = asyncio.Event()
        self._removals: set[asyncio.Future[None]] = set()
        self._task = asyncio.create_task(self._run(), name=f"checkpoints-{job_id}")

    def offer(self, line: TrainerCheckpoint) -> None:
        """Take a checkpoint the trainer announced; never waits."""
        path = inside(self.root, line.path)
        if path is None:
            self.logger.warning(
                Event.TRAINER_LINE_BAD,
                line=f"checkpoint {line.path}",
                error=f"a checkpoint must be a directory in {self.root}; ignored",
            )
            return
        if self.pending is not None:
            self.logger.info(
                Event.JOB_DIR_REMOVED,
                step=self.pending[0].step,
                message=f"checkpoint superseded by step {line.step} before it was sent",
            )
        self.pending = (line, path)
        self._dirs[line.step] = path
        # Removed in a thread: a checkpoint is many files, and the lines wait.
        removing = asyncio.ensure_future(asyncio.to_thread(remove_all, self._superseded()))
        self._removals.add(removing)
        removing.add_done_callback(self._removals.discard)
        self._wake.set()

    def _superseded(self) -> list[Path]:
        """The checkpoint directories older than the newest, except the one in
        flight, taken off the books (for the caller to remove)."""
        newest = max(self._dirs, default=0)
        busy = self.in_flight[0].step if self.in_flight is not None else None
        return [self._dirs.pop(s) for s in list(self._dirs) if s < newest and s != busy]

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self.pending is None:
                continue
            self.in_flight, self.pending = self.pending, None
            try:
                await self._send(*self.in_flight)
            except Exception as e:  # a checkpoint is worth a line, not the job
                self.logger.exception(Event.ARTIFACT_REJECTED, step=self.in_flight[0].step,
                                      error=repr(e))  # fmt: skip
            finally:
                self.in_flight = None
                await asyncio.to_thread(remove_all, self._superseded())

    async def _send(self, line: TrainerCheckpoint, path: Path) -> None:
        tar = self.root.parent / f"checkpoint-{line.step}.tar"
        try:
            await asyncio.to_thread(packing.pack_checkpoint, path, tar)
            await delivery.deliver(
                self.js,
                self.names,
                node=self.node,
                job_id=self.job_id,
                attempt=self.attempt,
                kind=ArtifactKind.CHECKPOINT,
                path=tar,
                chunk_bytes=self.chunk_bytes,
                step=line.step,
            )
        except (delivery.DeliveryError, OSError) as e:
            # Training goes on; the store keeps the checkpoint before this one.
            self.logger.warning(
                Event.ARTIFACT_REJECTED,
                kind=ArtifactKind.CHECKPOINT.value,
                step=line.step,
                error=f"the checkpoint at step {line.step} was not delivered: {e}",
            )
        finally:
            with contextlib.suppress(OSError):
                tar.unlink()

    async def stop(self) -> None:
        """Stop delivering; what is in flight is dropped (removals finish)."""
        await stop_tasks(self._task)
        if self._removals:
            await asyncio.wait(set(self._removals))
