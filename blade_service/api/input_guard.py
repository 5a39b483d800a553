"""Hostile input stops at the edge as a 422 naming the field, never as a database error (5xx).

PostgreSQL text and JSON cannot hold NUL (U+0000), and UTF-8 cannot encode a lone surrogate (U+D800-U+DFFF,
which a JSON `\\ud800` escape or a raw path can carry); a BIGINT holds -2^63..2^63-1. App-wide dependencies
cover every route, present and future, so no handler needs its own patch:

- `check_declared_params`: every path, query and header parameter the matched route declares (its own or its
  dependencies') is checked for unstorable characters, and integer ones for the int64 range.
- `check_json_body`: every string of a JSON request body, keys included, at any depth, every number
  (Python's json reads `NaN` and `Infinity`, which PostgreSQL's JSON refuses), and the nesting depth.

`SafeStr` / `SafeJson` state the same rule on the request schemas, for models built outside a request.
"""

from __future__ import annotations

import email.message
import functools
import json
import math
import types
from collections.abc import Iterator
from typing import Annotated, Any, Union, get_args, get_origin

from fastapi import Request
from pydantic import AfterValidator

from blade_service.persistence.errors import Invalid

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# No schema of ours nests half as deep; a client's `metadata` stored deeper could not be serialised back
# (pydantic's limit), so every later read of the request would fail.
MAX_JSON_DEPTH = 32


def unstorable(text: str) -> str | None:
    """Why `text` cannot be stored (NUL, a lone surrogate), or None when it can."""
    if "\x00" in text:
        return "contains a NUL character (U+0000), which cannot be stored"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"contains a lone surrogate (U+{ord(text[exc.start]):04X}), which is not valid Unicode text"
    return None


def _walk(value: Any, path: str, depth: int = 0) -> Iterator[tuple[str, str]]:
    """(path, problem) for every unstorable string (keys included) or non-finite number in a JSON value, and
    for nesting deeper than MAX_JSON_DEPTH."""
    if depth > MAX_JSON_DEPTH:
        yield path or "body", f"nested deeper than {MAX_JSON_DEPTH} levels"
    elif isinstance(value, str):
        if problem := unstorable(value):
            yield path, problem
    elif isinstance(value, float) and not math.isfinite(value):
        yield path, f"is {value}: JSON stores only finite numbers"
    elif isinstance(value, dict):
        for key, item in value.items():
            key_path = f"{path}.{key!s}" if path else str(key)
            if isinstance(key, str) and (problem := unstorable(key)):
                yield path or "body", f"a key {problem.removeprefix('contains ')}"
            yield from _walk(item, key_path, depth + 1)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _walk(item, f"{path}.{i}" if path else str(i), depth + 1)


def _storable_text(value: str) -> str:
    if problem := unstorable(value):
        raise ValueError(problem)
    return value


def _storable_json(value: Any) -> Any:
    found = next(_walk(value, ""), None)
    if found is not None:
        path, problem = found
        raise ValueError(f"{path}: {problem}" if path else problem)
    return value


SafeStr = Annotated[str, AfterValidator(_storable_text)]
SafeJson = Annotated[dict[str, Any], AfterValidator(_storable_json)]


def _is_int(annotation: Any) -> bool:
    options = get_args(annotation) if get_origin(annotation) in (Union, types.UnionType) else (annotation,)
    return int in options


def _declared(dependant: Any) -> Iterator[tuple[str, str, bool]]:
    """(location, name, is_int) of every path/query/header parameter of a route and its dependencies."""
    for location in ("path", "query", "header"):
        for field in getattr(dependant, f"{location}_params"):
            yield location, field.alias, _is_int(field.field_info.annotation)
    for sub in dependant.dependencies:
        yield from _declared(sub)


async def check_declared_params(request: Request) -> None:  # pure CPU: no thread hop
    """422 naming the parameter whose declared path/query/header value is unstorable or out of range."""
    route = request.scope.get("route")
    dependant = getattr(route, "dependant", None)
    if dependant is None:
        return
    for location, name, is_int in _declared(dependant):
        if location == "path":
            values = [request.path_params[name]] if name in request.path_params else []
        elif location == "query":
            values = request.query_params.getlist(name)
        else:
            values = request.headers.getlist(name.replace("_", "-"))  # as FastAPI converts underscores
        for value in values:
            if not isinstance(value, str):
                continue
            if problem := unstorable(value):
                raise Invalid(f"{name}: {problem}", code="validation_error", field=name)
            if is_int and _out_of_int64(value):
                raise Invalid(
                    f"{name}: must be an integer between {INT64_MIN} and {INT64_MAX}",
                    code="validation_error",
                    field=name,
                )


@functools.lru_cache(
    maxsize=256
)  # asked twice per request (BodySizeLimit, check_json_body); few distinct values
def parsed_as_json(content_type: str) -> bool:
    """Whether FastAPI reads a body of this Content-Type as JSON (fastapi.routing): `application/json` or
    `application/*+json` in any letter case, with any parameters, or no Content-Type at all."""
    if not content_type:
        return True
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


async def check_json_body(request: Request) -> None:
    """422 naming the field (`metadata.note`, `scopes.0`) when a JSON body holds an unstorable string."""
    if request.method in ("GET", "HEAD", "OPTIONS") or not parsed_as_json(
        request.headers.get("content-type", "")
    ):
        return
    try:
        body = json.loads(await request.body())
    except (ValueError, RecursionError):
        return  # not JSON, or absurdly nested: FastAPI's own parsing answers
    found = next(_walk(body, ""), None)
    if found is not None:
        path, problem = found
        raise Invalid(f"{path or 'body'}: {problem}", code="validation_error", field=path or "body")


def _out_of_int64(value: str) -> bool:
    try:
        number = int(value.strip())
    except ValueError:
        return False  # not an integer at all: FastAPI's own validation names it
    return not INT64_MIN <= number <= INT64_MAX
