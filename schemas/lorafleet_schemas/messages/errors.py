"""The body of every failed request."""

from __future__ import annotations

import enum

import msgspec


class ErrorCode(enum.StrEnum):
    BAD_REQUEST = "bad_request"
    NOT_FOUND = "not_found"
    CONFLICT = "conflict"
    UNAVAILABLE = "unavailable"
    INTERNAL = "internal"


class ErrorBody(msgspec.Struct, kw_only=True):
    code: ErrorCode
    message: str
    #: The request field at fault, as a JSON path (`$.params.rank`), when one is.
    field: str | None = None


class ErrorReply(msgspec.Struct, kw_only=True):
    """Every failed request is answered with this body (and Nats-Service-Error headers)."""

    error: ErrorBody
