"""lorafleet: train LoRA adapters on the GPU nodes that serve your LLMs, over NATS.

    from lorafleet import Client, Settings, NotFoundError

    async with await Client.connect(Settings.from_env()) as lf:
        job = await lf.submit(spec)

The public surface is what this package exports (`Client`, `Settings`, the
errors) and its public modules (`names`, `states`, `log`, `artifacts`,
`objects`, `access/`, `nats/`, ...). Modules whose names start with `_`,
here or in a subpackage, are plumbing for lorafleet's own services and
change without notice (docs/architecture.md).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    #: The one version of lorafleet: the installed distribution's.
    __version__ = version("lorafleet")
except PackageNotFoundError:  # a source tree on sys.path, not installed
    __version__ = "0.0.0+unknown"

from lorafleet.client import Client, JobFailedError
from lorafleet.errors import (
    ApiError,
    BadRequestError,
    ConflictError,
    ConnectError,
    InternalError,
    NotFoundError,
    UnavailableError,
)
from lorafleet.settings import Settings, SettingsError

__all__ = [
    "ApiError",
    "BadRequestError",
    "Client",
    "ConflictError",
    "ConnectError",
    "InternalError",
    "JobFailedError",
    "NotFoundError",
    "Settings",
    "SettingsError",
    "UnavailableError",
    "__version__",
]
