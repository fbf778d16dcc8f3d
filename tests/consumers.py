"""What the tests read from a JetStream consumer's info."""

from __future__ import annotations

from nats.js.api import ConsumerInfo


def redeliveries(info: ConsumerInfo) -> int:
    """Deliveries beyond one per stored message: each delivery takes a
    consumer sequence, each message one stream sequence (a consumer of the
    whole stream from its start). Not num_redelivered: that counts only
    redeliveries not yet acked, 0 again once they are."""
    return info.delivered.consumer_seq - info.delivered.stream_seq
