"""Every error the gateway answers, in OpenAI's shape and with its HTTP status.

`{"error": {"message", "type", "param", "code"}}`: the SDK raises its
class by the status (400 BadRequestError, 401 AuthenticationError, 404
NotFoundError, 409 ConflictError, 429 RateLimitError, 503
InternalServerError). A lorafleet service's error (`lorafleet.errors`)
keeps its message (it says what to change) and gets the status of its
code; no service answering at all is a 503.
"""

from __future__ import annotations

import msgspec
import nats.errors
from starlette.responses import Response

from lorafleet.errors import ApiError
from lorafleet_schemas.messages import ErrorCode
from lorafleet_services.gateway.openai_shapes import ErrorBody, ErrorDetail

_STATUS_OF_CODE = {
    ErrorCode.BAD_REQUEST: 400,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.CONFLICT: 409,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.INTERNAL: 500,
}

#: OpenAI's error `type` by HTTP status.
_TYPE_OF_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    409: "invalid_request_error",
    429: "rate_limit_exceeded",
    500: "server_error",
    502: "server_error",
    503: "server_error",
}


class GatewayHttpError(Exception):
    """An answer that is an error: `status`, and OpenAI's fields."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def response(self) -> Response:
        detail = ErrorDetail(
            message=self.message,
            type=_TYPE_OF_STATUS.get(self.status, "server_error"),
            param=self.param,
            code=self.code,
        )
        return Response(
            msgspec.json.encode(ErrorBody(error=detail)),
            status_code=self.status,
            media_type="application/json",
        )


def _param_of(field: str | None) -> str | None:
    """lorafleet's JSON path (`$.params.rank`) as OpenAI's param (`params.rank`)."""
    return field.removeprefix("$.") if field else None


def from_lorafleet(error: ApiError) -> GatewayHttpError:
    return GatewayHttpError(
        _STATUS_OF_CODE[error.code],
        error.message,
        param=_param_of(error.field),
        code=error.code.value,
    )


def unavailable(error: BaseException) -> GatewayHttpError:
    """No lorafleet service answered, or the bus itself did not (`error`: the
    NATS error or timeout): a 503 the SDK retries, never a bare 500."""
    if isinstance(error, nats.errors.NoRespondersError):
        what = "no lorafleet service answered: the control plane (recorder, scheduler) is down"
    elif isinstance(error, TimeoutError):
        what = "a lorafleet service did not answer in time: the control plane is down"
    else:  # JetStream mid-election, a connection reconnecting: the bus, not a service
        what = f"the bus (NATS) refused the request ({type(error).__name__}: {error}): it is down"
    return GatewayHttpError(
        503, f"{what} or restarting; retry in a few seconds", code="unavailable"
    )


def bad_request(message: str, param: str | None = None) -> GatewayHttpError:
    return GatewayHttpError(400, message, param=param, code="invalid_request")


def not_found(message: str, param: str | None = None, code: str = "not_found") -> GatewayHttpError:
    return GatewayHttpError(404, message, param=param, code=code)


def conflict(message: str, param: str | None = None) -> GatewayHttpError:
    return GatewayHttpError(409, message, param=param, code="conflict")
