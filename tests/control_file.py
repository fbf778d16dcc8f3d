"""A fault's control file: what a faked part (the clock shim, the slow
filesystem, the nemesis's engine) reads on each call. It is replaced whole,
so that a reader never meets it half written."""

from __future__ import annotations

import os
from pathlib import Path


def write_control(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
