"""lorafleet: train LoRA adapters on the GPU nodes that serve your LLMs, over NATS.

The public surface is what this package exports:

    from lorafleet import Client, Settings, NotFoundError

    async with await Client.connect(Settings.from_env()) as lf:
        job = await lf.submit(spec)

- `Client` (lorafleet.client): every call the `lorafleet` command makes;
- `Settings` (lorafleet.settings): LORAFLEET_* from the environment;
- the errors a call raises (lorafleet.errors): `ApiError` and one class per
  error code, `ConnectError` when no NATS server answers, `JobFailedError`
  from `Client.wait`;
- the public modules beside them: `names` (every subject, stream, bucket
  and header), `states` (the job state machine), `log` (the event
  vocabulary dashboards select on), `artifacts` and `objects` (artifact
  records, downloads), `access/` and `nats/` (server configs, an
  embedded server).

Modules whose names start with `_`, here or in a subpackage, are plumbing
for lorafleet's own services (`nats._bus` connections and requests,
`nats._micro` endpoints, `_runtime` the service lifecycle, `nats._consumer`
the JetStream pull loop, `_recorder_client` the control plane's client of
the recorder, `nats._natspy` the nats-py workarounds): they change without
notice. Every other module is public.

Import roots point downward only: `lorafleet_schemas` <- `lorafleet` <- `lorafleet_services`.
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
