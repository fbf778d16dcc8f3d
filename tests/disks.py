"""Small filesystems of a test's own, and filling them: the disk-full fault.

A tmpfs mounted (as root) where a nats-server keeps one stream, here the
object store's: `objects_dir` names that directory in a server's store, which
must exist before the server creates the stream. nats-server halts a stream
whose write fails for want of space (its writes then time out), and the
stream stays halted once the space is back until that server restarts.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

from lorafleet.names import Names, object_stream

#: The file `fill` writes (removed to give the space back).
FILLER = "filler"


def unavailable() -> str | None:
    """Why no tmpfs can be mounted here, or None."""
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    if shutil.which("mount") is None or shutil.which("umount") is None:
        return "no mount/umount"
    return None


def objects_dir(store_dir: Path, names: Names) -> Path:
    """Where a nats-server with `store_dir` keeps the artifacts' object store
    (the global account's JetStream, as every config here has)."""
    return store_dir / "jetstream" / "$G" / "streams" / object_stream(names.artifacts_bucket)


@contextlib.contextmanager
def small_filesystem(path: Path, size_mib: int) -> Iterator[Path]:
    """A tmpfs of `size_mib` MiB mounted at `path` while the block runs."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(path)], check=True
    )
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def fill(directory: Path) -> Path:
    """A file taking every byte left on `directory`'s filesystem."""
    filler = directory / FILLER
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        with contextlib.suppress(OSError):  # ENOSPC: full
            while True:
                os.write(fd, bytes(64 * 1024))
    finally:
        os.close(fd)
    return filler


def unfill(directory: Path) -> bool:
    """Give `fill`'s space back; True when there was a filler."""
    try:
        (directory / FILLER).unlink()
    except FileNotFoundError:
        return False
    return True
