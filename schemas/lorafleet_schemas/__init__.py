"""lorafleet's wire messages. See `lorafleet_schemas.messages`."""

from lorafleet_schemas.messages import *  # noqa: F403
from lorafleet_schemas.messages import PUBLISHED

__all__ = ["PUBLISHED"]
