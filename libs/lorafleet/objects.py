"""Reading objects out of a NATS object store.

`read_object` reads with one JetStream API call only (message gets on
`OBJ_<bucket>`), so a node whose credentials allow just
`names.msg_get_subject(bucket)` can read datasets, and the checkpoint or
adapter a resumed job starts from; `download_object` uses nats-py's own
get, written into a file (for users that may do more). Both
work around nats-py and live in lorafleet._natspy; this is their public face.
"""

from __future__ import annotations

from lorafleet._natspy import (
    ObjectDamagedError,
    ObjectNotFoundError,
    download_object,
    read_object,
)

__all__ = [
    "ObjectDamagedError",
    "ObjectNotFoundError",
    "download_object",
    "read_object",
]
