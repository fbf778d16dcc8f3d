"""Constrained field types the domains share: what may sit in a NATS subject,
a sha256, a card's MiB."""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from lorafleet_trainer.jobfile import SHA256_HEX_PATTERN

#: A token safe inside a NATS subject: node names, job ids, artifact kinds
#: (lorafleet.names checks the names it builds against it too).
SUBJECT_TOKEN_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
SubjectToken = Annotated[
    str,
    Meta(
        pattern=SUBJECT_TOKEN_PATTERN,
        description="letters, digits, '-' and '_' only (it becomes part of a NATS subject)",
    ),
]
Sha256Hex = Annotated[str, Meta(pattern=SHA256_HEX_PATTERN, description="lowercase hex sha256")]
PositiveMiB = Annotated[int, Meta(gt=0, description="MiB of one card")]

#: The most records one list request answers: a page of them fits a NATS
#: message. Whoever reads a whole listing asks for pages of this many.
LIST_MAX = 1000
ListLimit = Annotated[int, Meta(ge=1, le=LIST_MAX)]
