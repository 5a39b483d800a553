"""Cursor pages for every list endpoint: `{"items": [...], "has_more": bool, "next_cursor": str | null}`.

A cursor is opaque to clients (urlsafe base64 of a small JSON list: the sort key of the last item served), so
a page boundary stays put while rows are added in front of it. `offset` keeps working beside it for clients
that page by number. A route asks its service for `limit + 1` rows and hands them to `page`:

    rows = service.list_things(session, after=decode_cursor(cursor, "iso,str"), limit=limit + 1)
    return page([ThingOut.of(r) for r in rows], limit=limit, key=lambda t: [t.created_at, t.id])
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Annotated, Any, Generic, TypeVar

from fastapi import Query, Request
from pydantic import BaseModel as Schema
from pydantic import Field

from blade_service.api.input_guard import INT64_MAX, INT64_MIN, unstorable
from blade_service.persistence.errors import Invalid

T = TypeVar("T")

DEFAULT_LIMIT = 100
MAX_LIMIT = 1000

Limit = Annotated[int, Query(ge=1, le=MAX_LIMIT, description="items per page")]
Cursor = Annotated[
    str | None, Query(max_length=512, description="`next_cursor` of the previous page; omit for the first")
]
Offset = Annotated[int, Query(ge=0, description="items to skip (page by number; `cursor` is stabler)")]


def cursor_only(request: Request) -> None:
    """For a list that pages by cursor only: an `offset` is refused, not ignored (the client would get the
    first page again and think it the next)."""
    if "offset" in request.query_params:
        raise Invalid(
            "offset: this list pages by cursor only; pass the previous page's next_cursor", field="offset"
        )


class Page(Schema, Generic[T]):
    items: list[T]
    has_more: bool = Field(description="more items follow this page")
    next_cursor: str | None = Field(description="pass as `cursor` for the next page; null on the last")


def encode_cursor(values: Sequence[Any]) -> str:
    plain = [v.isoformat() if isinstance(v, datetime) else v for v in values]
    return base64.urlsafe_b64encode(json.dumps(plain, separators=(",", ":")).encode()).decode().rstrip("=")


def decode_cursor(cursor: str | None, kinds: str) -> list[Any] | None:
    """The sort key a cursor carries, typed by `kinds` ("iso,str": a datetime then a string); None for no
    cursor. Anything that is not a cursor of that shape is a 422 naming `cursor`."""
    if cursor is None:
        return None
    wanted = kinds.split(",")
    try:
        values = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
        if not isinstance(values, list) or len(values) != len(wanted):
            raise ValueError
        return [_typed(v, kind) for v, kind in zip(values, wanted, strict=True)]
    except (ValueError, TypeError, OverflowError, binascii.Error, UnicodeDecodeError):
        raise Invalid(
            "cursor: not a cursor of this list; pass `next_cursor` from the previous page unchanged",
            code="invalid_cursor",
            field="cursor",
        ) from None


def _typed(value: Any, kind: str) -> Any:
    if kind == "iso":  # lists compare aware datetimes: a forged naive or out-of-range one must not reach them
        moment = datetime.fromisoformat(value)
        if moment.tzinfo is None:
            raise ValueError
        return moment.astimezone(UTC)
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int) or not INT64_MIN <= value <= INT64_MAX:
            raise ValueError
        return value
    if not isinstance(value, str) or unstorable(value):  # a forged cursor must not reach the database
        raise ValueError
    return value


def page(items: list[T], *, limit: int, key: Callable[[T], Sequence[Any]]) -> Page[T]:
    """The first `limit` of `items` (fetched as limit + 1, so one more means `has_more`)."""
    has_more = len(items) > limit
    items = items[:limit]
    cursor = encode_cursor(key(items[-1])) if has_more and items else None
    return Page[T](items=items, has_more=has_more, next_cursor=cursor)


def page_after(
    items: list[T],
    *,
    cursor: str | None,
    kinds: str,
    limit: int,
    offset: int,
    key: Callable[[T], list[Any]],
    newest_first: bool = False,
) -> Page[T]:
    """Page a short list that is already complete and sorted by `key` (base models, keys, the adapter stack,
    webhooks): the items after the cursor's key, then `offset`, then `limit`. Ascending by default;
    `newest_first`: a (created_at, id) key sorted by time descending, ties by id ascending, as the database
    lists do."""
    after = decode_cursor(cursor, kinds)
    if after is not None:
        if newest_first:
            items = [i for i in items if _newer_first_after(key(i), after)]
        else:
            items = [i for i in items if key(i) > after]
    return page(items[offset : offset + limit + 1], limit=limit, key=key)


def _newer_first_after(k: list[Any], after: list[Any]) -> bool:
    newer: bool = k[0] < after[0] or (k[0] == after[0] and k[1] > after[1])
    return newer
