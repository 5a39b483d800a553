"""Errors the service functions raise; the API sends each as `{"error": {"code", "message"}}`."""

from __future__ import annotations


class ServiceError(Exception):
    status: int = 400
    code: str = "bad_request"

    def __init__(self, message: str, *, code: str | None = None, field: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field
        if code:
            self.code = code


class NotFound(ServiceError):
    status, code = 404, "not_found"


class Conflict(ServiceError):
    status, code = 409, "conflict"


class Invalid(ServiceError):
    """Well-formed but unusable input (a bad dataset, an unknown parameter); names the field."""

    status, code = 422, "invalid"


class Unauthorized(ServiceError):
    status, code = 401, "unauthorized"


class Forbidden(ServiceError):
    status, code = 403, "forbidden"


class TooLarge(ServiceError):
    status, code = 413, "too_large"


class TooManyRequests(ServiceError):
    status, code = 429, "too_many_requests"


class Unavailable(ServiceError):
    status, code = 503, "unavailable"


class GatewayTimeout(ServiceError):
    status, code = 504, "timeout"
