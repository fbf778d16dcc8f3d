"""Constrained field types the domains share: what may sit in a NATS subject,
a sha256, a card's MiB."""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

#: A token safe inside a NATS subject: node names, job ids, artifact kinds.
SubjectToken = Annotated[
    str,
    Meta(
        pattern=r"^[A-Za-z0-9_-]{1,64}$",
        description="letters, digits, '-' and '_' only (it becomes part of a NATS subject)",
    ),
]
Sha256Hex = Annotated[str, Meta(pattern=r"^[0-9a-f]{64}$", description="lowercase hex sha256")]
PositiveMiB = Annotated[int, Meta(gt=0, description="MiB of one card")]
