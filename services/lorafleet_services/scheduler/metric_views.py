"""The scheduler's live gauges: its node table (nodes, cards, heartbeat age,
adapters loaded).

`Scheduler.start` adds its view (these samples and leadership) to
`metrics.LIVE` and removes it at stop.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from lorafleet.metrics import (
    CARD_FREE,
    CARD_TOTAL,
    HEARTBEAT_AGE,
    NODE_ADAPTERS,
    NODE_BUSY,
    NODE_UP,
    NODES_ALIVE,
    Sample,
)
from lorafleet_schemas.messages import Heartbeat
from lorafleet_trainer.memory import MIB


def node_samples(nodes: Iterable[tuple[Heartbeat, bool, float]]) -> Iterator[Sample]:
    """Samples of (heartbeat, alive, seconds since it arrived) for each known node."""
    alive = 0
    for hb, up, age_s in nodes:
        alive += up
        yield NODE_UP, (hb.node,), float(up)
        yield NODE_BUSY, (hb.node,), float(up and hb.job is not None)
        yield HEARTBEAT_AGE, (hb.node,), max(0.0, age_s)
        if not up:
            continue  # a lost node's cards say nothing about now
        yield NODE_ADAPTERS, (hb.node,), float(sum(len(e.adapters) for e in hb.serving))
        for card in hb.cards:
            labels = (hb.node, str(card.index), card.name)
            yield CARD_TOTAL, labels, float(card.total_mib * MIB)
            yield CARD_FREE, labels, float(card.free_mib * MIB)
    yield NODES_ALIVE, (), float(alive)
