"""Bytes between the node and the artifact-store.

- packing: adapters and checkpoints into reproducible tars, and back;
- delivery: a file as chunks on the artifacts stream, acknowledged;
- checkpoints: a training job's checkpoints, packed and delivered as they come;
- fetch: objects (datasets, checkpoints, adapters) fetched and checked.
"""

from lorafleet_services.agent.transfer.checkpoints import CheckpointSender
from lorafleet_services.agent.transfer.delivery import DeliveryError, deliver
from lorafleet_services.agent.transfer.fetch import (
    DatasetFetchError,
    fetch_checked,
    fetch_datasets,
    fetch_object,
)
from lorafleet_services.agent.transfer.packing import pack_adapter, pack_checkpoint, unpack

__all__ = [
    "CheckpointSender",
    "DatasetFetchError",
    "DeliveryError",
    "deliver",
    "fetch_checked",
    "fetch_datasets",
    "fetch_object",
    "pack_adapter",
    "pack_checkpoint",
    "unpack",
]
