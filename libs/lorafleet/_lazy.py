"""A package's names imported on first use (PEP 562), so that importing one
of its modules does not import the others: it breaks import cycles between
subpackages, and keeps torch out of what does not need it."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping


def lazy_exports(package: str, home: Mapping[str, str]) -> Callable[[str], object]:
    """The `__getattr__` for `package`: `home` maps each exported name to the
    submodule that defines it."""

    def __getattr__(name: str) -> object:
        if name not in home:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{home[name]}"), name)

    return __getattr__
