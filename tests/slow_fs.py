"""A disk that stalls: a FUSE passthrough over a directory whose writes and
fsyncs each take `delay_s` longer while its control file says so (the
nemesis's disk.slow, under one NATS member's store: tests/disks.py mounts
it). Device-mapper's delay target would be the kernel's way, but it needs
/dev/mapper/control, which containers rarely have; /dev/fuse they do.

`python -m tests.slow_fs BACKING MOUNT CONTROL` serves MOUNT from BACKING
until unmounted; CONTROL holds the stall in seconds (absent: none), read at
most every CONTROL_READ_S. Each call runs on a thread of its own (fusepy's
multithreaded loop), so a stall holds up each writer, not the whole disk at
once; reads are never stalled. The passthrough costs a Python call per
operation: tens of microseconds, felt by the member's small raft writes
only while the nemesis runs.
"""

from __future__ import annotations

import errno
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from fuse import FUSE, FuseOSError, Operations  # type: ignore[import-untyped]

#: Seconds between two reads of the control file.
CONTROL_READ_S = 0.1

_STAT = ("st_atime", "st_ctime", "st_gid", "st_mode", "st_mtime", "st_nlink", "st_size", "st_uid")
_STATVFS = ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files",
            "f_flag", "f_frsize", "f_namemax")  # fmt: skip


class SlowPassthrough(Operations):  # type: ignore[misc]
    def __init__(self, backing: Path, control: Path) -> None:
        self.backing = backing
        self.control = control
        self._lock = threading.Lock()
        self._read_at = 0.0
        self._delay_s = 0.0

    def __call__(self, op: str, *args: Any) -> Any:
        try:
            return super().__call__(op, *args)
        except OSError as e:  # the backing's errno, as the kernel would give it
            raise FuseOSError(e.errno or errno.EIO) from e

    def _path(self, path: str) -> str:
        return os.path.join(self.backing, path.lstrip("/"))

    def _stall(self) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._read_at >= CONTROL_READ_S:
                self._read_at = now
                try:
                    self._delay_s = float(self.control.read_text() or 0)
                except (OSError, ValueError):
                    self._delay_s = 0.0
            delay_s = self._delay_s
        if delay_s > 0:
            time.sleep(delay_s)

    # --- the stalled calls ---
    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        self._stall()
        return os.pwrite(fh, data, offset)

    def fsync(self, path: str, datasync: int, fh: int) -> None:
        self._stall()
        os.fdatasync(fh) if datasync else os.fsync(fh)

    # --- the rest, passed through ---
    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        st = os.lstat(self._path(path))
        return {k: getattr(st, k) for k in _STAT}

    def statfs(self, path: str) -> dict[str, Any]:
        st = os.statvfs(self._path(path))
        return {k: getattr(st, k) for k in _STATVFS}

    def readdir(self, path: str, fh: int) -> list[str]:
        return [".", "..", *os.listdir(self._path(path))]

    def access(self, path: str, amode: int) -> None:
        if not os.access(self._path(path), amode):
            raise FuseOSError(errno.EACCES)

    def mkdir(self, path: str, mode: int) -> None:
        os.mkdir(self._path(path), mode)

    def rmdir(self, path: str) -> None:
        os.rmdir(self._path(path))

    def unlink(self, path: str) -> None:
        os.unlink(self._path(path))

    def rename(self, old: str, new: str) -> None:
        os.rename(self._path(old), self._path(new))

    def chmod(self, path: str, mode: int) -> None:
        os.chmod(self._path(path), mode)

    def chown(self, path: str, uid: int, gid: int) -> None:
        os.chown(self._path(path), uid, gid)

    def utimens(self, path: str, times: tuple[float, float] | None = None) -> None:
        os.utime(self._path(path), times)

    def truncate(self, path: str, length: int, fh: int | None = None) -> None:
        os.truncate(self._path(path) if fh is None else fh, length)

    def open(self, path: str, flags: int) -> int:
        return os.open(self._path(path), flags)

    def create(self, path: str, mode: int, fi: Any = None) -> int:
        return os.open(self._path(path), os.O_RDWR | os.O_CREAT, mode)

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        return os.pread(fh, size, offset)

    def flush(self, path: str, fh: int) -> None:
        return None

    def release(self, path: str, fh: int) -> None:
        os.close(fh)


def main(backing: str, mount: str, control: str) -> None:
    FUSE(SlowPassthrough(Path(backing), Path(control)), mount, foreground=True, nothreads=False)


if __name__ == "__main__":
    main(*sys.argv[1:4])
