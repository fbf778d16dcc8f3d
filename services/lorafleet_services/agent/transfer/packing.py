"""Artifacts packed and unpacked: directories into tars that are the same
bytes for the same files, and a fetched tar back into a directory.

`pack_adapter()` makes the `peft` artifact, a tar.gz of the adapter
directory; `pack_checkpoint()` the `checkpoint` artifact, the same as a
plain tar; `unpack()` undoes either, refusing what could leave its target.
"""

from __future__ import annotations

import contextlib
import gzip
import os
import shutil
import tarfile
from pathlib import Path
from typing import BinaryIO

from lorafleet_services.agent.transfer.delivery import DeliveryError


def _tarinfo(name: str, *, is_dir: bool, size: int = 0) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type = tarfile.DIRTYPE if is_dir else tarfile.REGTYPE
    ti.mode = 0o755 if is_dir else 0o644
    ti.size = size
    ti.mtime = 0
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = ""
    return ti


def pack_adapter(adapter_dir: Path, out_file: Path) -> Path:
    """Pack `adapter_dir` into `out_file` as a tar.gz that is the same bytes for the same files.

    Names are sorted and relative, times, owners and modes are fixed, gzip
    carries no name or time. Links and other special files are refused.
    `out_file` appears only once complete.
    """
    return pack_dir(adapter_dir, out_file, compress=True, what="an adapter")


def pack_checkpoint(checkpoint_dir: Path, out_file: Path) -> Path:
    """Pack a checkpoint directory into `out_file` as a plain tar (see pack_dir).

    Not compressed: weights and optimizer states hardly shrink, and gzip's
    CPU would be taken from the training that goes on meanwhile.
    """
    return pack_dir(checkpoint_dir, out_file, compress=False, what="a checkpoint")


def _entries(src: Path, what: str) -> list[tuple[str, Path]]:
    """Every file and directory under `src`, as (relative name, path), sorted."""
    entries: list[tuple[str, Path]] = []
    for root, dirs, files in os.walk(src):
        dirs.sort()
        rel_root = Path(root).relative_to(src)
        for name in sorted(dirs) + sorted(files):
            p = Path(root) / name
            if p.is_symlink() or not (p.is_dir() or p.is_file()):
                raise DeliveryError(
                    f"{p} is a link or a special file; {what} holds only regular files"
                )
            entries.append(((rel_root / name).as_posix(), p))
    entries.sort(key=lambda e: e[0])
    return entries


def pack_dir(src: Path, out_file: Path, *, compress: bool, what: str = "an artifact") -> Path:
    """Pack the directory `src` into `out_file`, a tar (gzip'ed with `compress`)
    that is the same bytes for the same files: names sorted and relative,
    times, owners and modes fixed, gzip with no name or time. Links and
    special files are refused (`what` names the directory in the message).
    `out_file` appears only once complete."""
    src, out_file = Path(src), Path(out_file)
    if not src.is_dir():
        raise DeliveryError(f"the directory {src} ({what}) does not exist")
    entries = _entries(src, what)
    tmp = out_file.with_name(f".{out_file.name}.part")
    out_file.parent.mkdir(parents=True, exist_ok=True)
    try:
        with tmp.open("wb") as raw, contextlib.ExitStack() as stack:
            fileobj: BinaryIO | gzip.GzipFile = raw
            if compress:
                fileobj = stack.enter_context(
                    gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=6)
                )
            tar = stack.enter_context(
                tarfile.open(fileobj=fileobj, mode="w", format=tarfile.GNU_FORMAT)
            )
            for name, p in entries:
                if p.is_dir():
                    tar.addfile(_tarinfo(name, is_dir=True))
                else:
                    with p.open("rb") as f:
                        tar.addfile(_tarinfo(name, is_dir=False, size=p.stat().st_size), f)
        os.replace(tmp, out_file)
    finally:
        tmp.unlink(missing_ok=True)
    return out_file


# --- delivery ------------------------------------------------------------------


def unpack(archive: Path, target: Path) -> None:
    """Unpack the tar (or tar.gz) `archive` into `target` (made afresh).

    tarfile's "data" filter refuses what could leave `target` or change the
    node (absolute names, `..`, links pointing outside, devices) and drops
    set-id bits: the archive came over the network.
    """
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True, mode=0o755)
    with tarfile.open(archive, mode="r:*") as tar:
        tar.extractall(target, filter="data")
