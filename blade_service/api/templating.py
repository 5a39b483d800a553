"""The Jinja2 environment of `dashboard/templates` and its filters, shared by the dashboard's pages and the
printable certificate (`routes/certificates.py`)."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi.templating import Jinja2Templates

TEMPLATES_DIR = Path(__file__).resolve().parent / "dashboard" / "templates"
templates = Jinja2Templates(directory=str(TEMPLATES_DIR))


def _ago(value: datetime | float | None) -> str:
    if value is None:
        return "—"
    seconds = (
        value
        if isinstance(value, int | float)
        else (datetime.now(UTC) - (value if value.tzinfo else value.replace(tzinfo=UTC))).total_seconds()
    )
    seconds = max(0, seconds)
    if seconds < 1:
        return "just now"
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit} ago"
    return f"{seconds:.0f} s ago"


def _dt(value: datetime | str | None) -> str:
    if value is None:
        return "—"
    if isinstance(value, str):  # an ISO 8601 string (the certificate's JSON)
        try:
            when = datetime.fromisoformat(value)
        except ValueError:
            return value
    else:
        when = value
    return when.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _num(value: Any, digits: int = 4) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
            return f"{value:.{digits - 1}e}"
        return f"{value:.{digits}g}" if abs(value) >= 1 else f"{value:.{digits}f}".rstrip("0").rstrip(".")
    return str(value)


def _duration(start: datetime | None, end: datetime | None) -> str:
    if start is None:
        return "—"
    end = end or datetime.now(UTC)
    seconds = max(0.0, (end - start).total_seconds())
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _bytes(value: int | None) -> str:
    if value is None:
        return "—"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(value)


templates.env.filters.update(ago=_ago, dt=_dt, num=_num, bytes=_bytes, short=lambda s, n=12: (s or "")[:n])
templates.env.globals.update(duration=_duration)
