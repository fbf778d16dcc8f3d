"""lorafleet's request errors: one family, one class per error code.

A handler raises one (`raise NotFoundError("no job j1", "$.id")`) and the
service answers with the micro error headers and the JSON body
`{"error": {"code": "not_found", "message": ..., "field": ...}}`; a caller's
`bus.request` turns that body back into the same class. So code asks
`except NotFoundError:`, never compares code strings, and a message that
says what to change travels unchanged from the service that knew it to the
operator who reads it.
"""

from __future__ import annotations

from typing import ClassVar

import msgspec

from lorafleet.names import Header
from lorafleet_schemas.messages import ErrorBody, ErrorCode, ErrorReply

_reply_decoder = msgspec.json.Decoder(ErrorReply)
_encoder = msgspec.json.Encoder()


class ApiError(Exception):
    """An error a lorafleet request is answered with. `message` says what to
    change; `field` (a JSON path such as `$.params.rank`) names the culprit."""

    code: ClassVar[ErrorCode] = ErrorCode.INTERNAL

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field

    def __str__(self) -> str:
        where = f" (at {self.field})" if self.field else ""
        return f"{self.code.value}: {self.message}{where}"

    def body(self) -> bytes:
        """The reply body that carries this error."""
        return error_body(self.code, self.message, self.field)


class BadRequestError(ApiError):
    """The request itself is wrong: change it as the message says."""

    code = ErrorCode.BAD_REQUEST


class NotFoundError(ApiError):
    """What the request names does not exist."""

    code = ErrorCode.NOT_FOUND


class ConflictError(ApiError):
    """The request does not fit the current state (a name taken, a job moved on)."""

    code = ErrorCode.CONFLICT


class UnavailableError(ApiError):
    """The service cannot answer now; the same request may succeed later."""

    code = ErrorCode.UNAVAILABLE


class InternalError(ApiError):
    """The service failed on the request (its log has the details)."""

    code = ErrorCode.INTERNAL


class ConnectError(ConnectionError):
    """No NATS server answered at the configured URL, or it refused these
    credentials (or, the recorder's DatabaseUnavailableError, its database
    did not answer); the message says which setting to change."""


_BY_CODE: dict[str, type[ApiError]] = {
    cls.code.value: cls
    for cls in (BadRequestError, NotFoundError, ConflictError, UnavailableError, InternalError)
}

#: micro's numeric codes (the Nats-Service-Error-Code header) for ours, so
#: clients that read only headers see HTTP-like codes.
HTTP_CODES: dict[ErrorCode, str] = {
    ErrorCode.BAD_REQUEST: "400",
    ErrorCode.NOT_FOUND: "404",
    ErrorCode.CONFLICT: "409",
    ErrorCode.UNAVAILABLE: "503",
    ErrorCode.INTERNAL: "500",
}
_BY_HTTP_CODE = {http: _BY_CODE[code.value] for code, http in HTTP_CODES.items()}


def error_for(code: str, message: str, field: str | None = None) -> ApiError:
    """The error of `code` (ours, or micro's HTTP-like one); a code this
    version does not know is kept in the message of an InternalError (a
    newer service may send one)."""
    cls = _BY_CODE.get(code) or _BY_HTTP_CODE.get(code)
    if cls is None:
        return InternalError(f"{code}: {message}", field)
    return cls(message, field)


def error_body(code: ErrorCode, message: str, field: str | None = None) -> bytes:
    return _encoder.encode(ErrorReply(error=ErrorBody(code=code, message=message, field=field)))


def raise_for_error(data: bytes, headers: dict[str, str] | None) -> None:
    """Raise the ApiError a reply carries, if it is a lorafleet (or micro) error."""
    if not ((headers and Header.SERVICE_ERROR_CODE in headers) or data.startswith(b'{"error"')):
        return
    try:
        body = _reply_decoder.decode(data).error
    except msgspec.DecodeError:
        # A micro error from a service that is not lorafleet's: headers only.
        hdr = headers or {}
        raise error_for(
            hdr.get(Header.SERVICE_ERROR_CODE, ErrorCode.INTERNAL.value),
            hdr.get(Header.SERVICE_ERROR, data.decode(errors="replace")),
        ) from None
    raise error_for(body.code.value, body.message, body.field)
