"""Every error status an operation can return is declared in /openapi.json, with the real error body.

Errors leave as `{"error": {"code", "message", "field"?}}` (`ErrorOut`), never FastAPI's default 422 shape.
`install_error_responses` adds the statuses that follow from what an operation is, once, when the document is
built (tests/test_api_fuzz.py fuzzes the whole document and fails on any status not declared):

| status | when | declared on |
| --- | --- | --- |
| 400 | a malformed request the service refuses (e.g. an unparsable multipart body) | every keyed operation |
| 401 / 403 | no valid key / the key lacks the scope | every keyed operation |
| 404 | no such object, or another tenant's | operations with a path parameter |
| 409 | the change conflicts with the current state | every POST, PUT, PATCH, DELETE |
| 413 | the body is over the upload limit | operations with a body |
| 422 | a parameter or body field is invalid or unstorable (names the field) | operations with input |
| 503 | the database or the artifact store is unavailable | every keyed operation |

Operations declare anything further themselves: `responses=error_responses(429, 502, 504)`.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from blade_service.api.openapi_docs import extend_openapi
from blade_service.api.schemas import ErrorInfo, ErrorOut

DESCRIPTIONS = {
    400: "Bad request",
    401: "Missing, unknown or revoked API key",
    403: "The API key lacks the scope",
    404: "Not found (or not yours)",
    409: "Conflicts with the current state",
    413: "Request body too large",
    422: "Invalid input; `error.field` names the field",
    429: "Too many calls of this API process wait for a worker; retry after `Retry-After` seconds",
    502: "The worker failed",
    503: "A backing service is unavailable; retry",
    504: "No worker answered in time",
}
_ERROR_REF = {"$ref": "#/components/schemas/ErrorOut"}
_WRITES = {"post", "put", "patch", "delete"}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` for a route decorator: these statuses with the error body."""
    return {s: {"model": ErrorOut, "description": DESCRIPTIONS.get(s, "Error")} for s in statuses}


def _statuses(method: str, op: dict[str, Any]) -> set[int]:
    params = op.get("parameters", [])
    keyed = bool(op.get("security"))
    found: set[int] = set()
    if keyed:
        found |= {400, 401, 403, 503}
    if any(p.get("in") == "path" for p in params):
        found.add(404)
    if method in _WRITES:
        found.add(409)
    if "requestBody" in op:
        found.add(413)
    if params or "requestBody" in op:
        found.add(422)
    return found


def _declare(schema: dict[str, Any]) -> dict[str, Any]:
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for model in (ErrorInfo, ErrorOut):
        definition = model.model_json_schema(ref_template="#/components/schemas/{model}")
        definition.pop("$defs", None)
        components.setdefault(model.__name__, definition)
    components.pop("HTTPValidationError", None)
    components.pop("ValidationError", None)
    for item in schema.get("paths", {}).values():
        for method, op in item.items():
            if not isinstance(op, dict) or "responses" not in op:
                continue
            responses = op["responses"]
            for status in sorted(_statuses(method, op)):
                existing = responses.get(str(status))
                if existing is None or "HTTPValidationError" in str(existing):
                    responses[str(status)] = {
                        "description": DESCRIPTIONS[status],
                        "content": {"application/json": {"schema": _ERROR_REF}},
                    }
    return schema


def install_error_responses(app: FastAPI) -> None:
    """Wrap `app.openapi` so the document declares every error status with `ErrorOut`."""
    extend_openapi(app, _declare)
