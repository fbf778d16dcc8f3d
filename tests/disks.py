"""Small filesystems of a test's own, and filling them: the disk-full fault;
and a filesystem that stalls its writes: the slow-disk fault (slow_fs.py).

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
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from lorafleet._process import die_with_parent
from lorafleet.names import Names, object_stream
from tests.control_file import write_control

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
        unmount(path)


#: Seconds `unmount` waits for a busy filesystem before detaching it lazily.
UNMOUNT_WAIT_S = 10.0


def unmount(path: Path) -> None:
    """Unmount `path`, waiting (bounded) while it is busy: a process that
    held a file there may still be exiting (CI: PostgreSQL's backends after
    `pg_ctl stop -m immediate`, "target is busy"). Then lazily (`-l`): a
    tmpfs detached now is freed when its last user goes."""
    deadline = time.monotonic() + UNMOUNT_WAIT_S
    for _ in range(100):
        if subprocess.run(["umount", str(path)], capture_output=True).returncode == 0:
            return
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    subprocess.run(["umount", "-l", str(path)], check=True)


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


#: Seconds a slow filesystem may take to be mounted.
MOUNT_TIMEOUT_S = 15.0


def slow_unavailable() -> str | None:
    """Why no slow filesystem can be mounted here, or None."""
    if os.geteuid() != 0:
        return "mounting a FUSE filesystem needs root here"
    if not os.path.exists("/dev/fuse") or shutil.which("fusermount") is None:
        return "no /dev/fuse or fusermount (apt-get install fuse)"
    try:
        import fuse  # type: ignore[import-untyped]  # noqa: F401
    except (ImportError, OSError) as e:  # OSError: fusepy without libfuse.so.2
        return f"fusepy does not load ({e}): pip install fusepy, apt-get install libfuse2"
    return None


@dataclass
class SlowDisk:
    """The stall of a slow filesystem: `stall(delay_s)` makes each write and
    fsync under it take that much longer, `clear()` ends it."""

    control: Path

    def stall(self, delay_s: float) -> None:
        write_control(self.control, f"{delay_s}\n")

    def clear(self) -> None:
        self.control.unlink(missing_ok=True)


@contextlib.contextmanager
def slow_filesystem(path: Path) -> Iterator[SlowDisk]:
    """`path` served by a FUSE passthrough (tests/slow_fs.py) over a directory
    beside it, while the block runs; not stalled until told."""
    backing = path.with_name(path.name + ".backing")
    control = path.with_name(path.name + ".stall")
    for d in (path, backing):
        d.mkdir(parents=True, exist_ok=True)
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    argv = [sys.executable, "-m", "tests.slow_fs", str(backing), str(path), str(control)]
    proc = subprocess.Popen(die_with_parent(argv), env=env, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + MOUNT_TIMEOUT_S
        while not os.path.ismount(path):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"the slow filesystem at {path} did not mount (exit {proc.poll()})"
                )
            time.sleep(0.05)
        yield SlowDisk(control)
    finally:
        control.unlink(missing_ok=True)
        if os.path.ismount(path):
            subprocess.run(["fusermount", "-u", "-z", str(path)], check=False)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
