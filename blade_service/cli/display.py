"""How the client verbs show things: tables, a live progress bar while a request runs, a before/after summary.

Tables and the bar are `rich`'s on a terminal. Off one (a pipe, a log, CI) tables become tab-separated lines
and the bar one plain line per new step, so output stays whole and greppable whatever the width.

    watch = RunWatch(console)            # feed it each polled state and the newest history record
    watch.update(state, record); watch.close()
    print_table(console, rows, ["id", "status", "progress"])
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from blade_core.heartbeat import duration

# The history.json columns worth a glance, in order (CONTRACT.md `history.json`); others stay in --json.
EVENT_COLUMNS = ("step", "L_fgt", "L_ret", "lambda", "r", "epsilon", "lr", "converged", "dt")
STREAM_WIDTH = 10  # a column of print_stream_rows: fmt's 4 significant digits with sign and exponent
NOT_METRICS = frozenset({"n", "rows", "count", "seconds", "time_s"})  # sizes and timings, not scores
NOT_METRIC_GROUPS = frozenset({"settings"})  # how the metrics were measured
ISO_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)?")


def fmt(value: Any) -> str:
    """Compact cell text: 4 significant digits for floats, '—' for nothing."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        return f"{value:.4g}"
    if isinstance(value, dict | list):
        return json.dumps(value, default=str)
    if isinstance(value, str) and ISO_TIME.fullmatch(value):
        return value[:19].replace("T", " ")  # to the second, UTC as the API gives it
    return str(value)


def print_json(doc: Any) -> None:
    print(json.dumps(doc, indent=2, sort_keys=True, default=str))


def print_table(
    console: Console,
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[str],
    title: str | None = None,
) -> None:
    """Rows as rich's table on a terminal wide enough for every cell whole; on a narrower one each row as a
    record; off a terminal tab-separated lines, the column names first, for grep, cut and awk."""
    cells = [[fmt(row.get(c)) for c in columns] for row in rows]
    if not console.is_terminal:
        _print_lines(console, [list(columns), *cells], title)
        return
    table = Table(title=title, show_lines=False, header_style="bold")
    for column in columns:
        table.add_column(column, no_wrap=True)
    for line in cells:
        table.add_row(*(cell.replace("\t", " ") for cell in line))  # rich mis-measures a tab
    unbounded = console.options.update_width(sys.maxsize)
    if console.measure(table, options=unbounded).maximum > console.width:  # else rich squeezes columns
        for i, row in enumerate(rows):
            print_record(console, {c: row.get(c) for c in columns}, title if i == 0 else None)
        return
    console.print(table)


def print_stream_rows(
    console: Console, rows: Sequence[Mapping[str, Any]], columns: Sequence[str], title: str | None = None
) -> None:
    """Rows that arrive a few at a time (`blade events --follow`), under one header: fixed-width columns on
    a terminal, so each batch lines up with the last; tab-separated lines off one. With `title`, the title
    and the column names come first."""
    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    if not console.is_terminal:
        _print_lines(console, [list(columns), *cells] if title else cells, title)
        return
    widths = [max(len(c), STREAM_WIDTH) for c in columns]
    lines = [[c.rjust(w) for c, w in zip(line, widths, strict=True)] for line in cells]
    if title:
        console.print(title, style="bold", markup=False, highlight=False)
        header = [c.rjust(w) for c, w in zip(columns, widths, strict=True)]
        console.print("  ".join(header), style="bold", markup=False, highlight=False)
    for line in lines:
        console.print("  ".join(line), markup=False, highlight=False)


def print_record(console: Console, doc: Mapping[str, Any], title: str | None = None) -> None:
    """One object as a two-column table of its fields (off a terminal: a `field<TAB>value` line each)."""
    if not console.is_terminal:
        _print_lines(console, [[key, fmt(value)] for key, value in doc.items()], title)
        return
    table = Table(title=title, show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    for key, value in doc.items():
        table.add_row(key, fmt(value))
    console.print(table)


def _print_lines(console: Console, lines: Sequence[Sequence[str]], title: str | None) -> None:
    """Tab-separated lines, each cell on one line; the title as a `# ` line before them."""
    out = [f"# {title}"] if title else []
    out += ["\t".join(" ".join(cell.split()) for cell in line) for line in lines]
    if out:
        print("\n".join(out), file=console.file, flush=True)


def progress_text(state: Mapping[str, Any]) -> str:
    """'step 12/250 (4.8%) · ETA 2.1 min' from a request's `progress`; 'step 38, converged (cap 250)' once
    its convergence stop ended it (the cap is then no total it fell short of)."""
    p = state.get("progress") or {}
    step, total = p.get("step", 0), p.get("total_steps")
    if state.get("converged"):
        return f"step {step}, converged" + (f" (cap {total})" if total else "")
    text = f"step {step}/{total}" if total else f"step {step}"
    if p.get("fraction") is not None and total:
        text += f" ({100 * p['fraction']:.1f}%)"
    if p.get("eta_seconds") is not None:
        text += f" · ETA {duration(p['eta_seconds'])}"
    if state.get("queue_position"):
        text += f" · {state['queue_position']} ahead in the queue"
    return text


def dynamics_text(record: Mapping[str, Any] | None) -> str:
    """'λ 1.2 · L_fgt 0.31 · L_ret 2.05' from the newest history record."""
    if not record:
        return ""
    parts = [
        (label, record.get(key)) for label, key in (("λ", "lambda"), ("L_fgt", "L_fgt"), ("L_ret", "L_ret"))
    ]
    return " · ".join(f"{label} {fmt(value)}" for label, value in parts if value is not None)


class RunWatch:
    """A live bar (step/total, λ, L_fgt, L_ret, ETA) on a terminal; one line per new step otherwise."""

    def __init__(self, console: Console, request_id: str):
        self.console, self.request_id = console, request_id
        self.live = console.is_terminal
        self.last_line = ""
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        if self.live:
            self._progress = Progress(
                TextColumn("[bold]{task.fields[status]}"),
                BarColumn(),
                TextColumn("{task.fields[where]}"),
                TextColumn("{task.fields[dynamics]}"),
                TimeElapsedColumn(),
                console=console,
                transient=False,
            )
            self._task = self._progress.add_task(request_id, total=None, status="", where="", dynamics="")
            self._progress.start()

    def update(self, state: Mapping[str, Any], record: Mapping[str, Any] | None) -> None:
        p = state.get("progress") or {}
        where, dynamics = progress_text(state), dynamics_text(record)
        if self._progress is not None and self._task is not None:
            self._progress.update(
                self._task,
                total=p.get("total_steps"),
                completed=p.get("step", 0),
                status=state.get("status", ""),
                where=where,
                dynamics=dynamics,
            )
            return
        line = f"{self.request_id} {state.get('status')}: {where}" + (f" · {dynamics}" if dynamics else "")
        if line != self.last_line:
            self.console.print(line, highlight=False, soft_wrap=True)
            self.last_line = line

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, Mapping):
        for key, inner in value.items():
            _flatten(f"{prefix}.{key}" if prefix else str(key), inner, out)
    else:
        out[prefix] = value


def metric_rows(before: Mapping[str, Any] | None, after: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """One row per numeric metric (dotted names for nested groups): before, after and the change."""
    b: dict[str, Any] = {}
    a: dict[str, Any] = {}
    _flatten("", before or {}, b)
    _flatten("", after or {}, a)
    rows = []
    for name in dict.fromkeys([*b, *a]):
        parts = name.split(".")
        if parts[0] in NOT_METRIC_GROUPS or parts[-1] in NOT_METRICS or parts[-1].startswith("n_"):
            continue
        vb, va = b.get(name), a.get(name)
        numbers = [v for v in (vb, va) if isinstance(v, int | float) and not isinstance(v, bool)]
        if not numbers:
            continue
        change = va - vb if isinstance(va, int | float) and isinstance(vb, int | float) else None
        rows.append({"metric": name, "before": vb, "after": va, "change": change})
    return rows


def print_summary(console: Console, state: Mapping[str, Any], metrics: Mapping[str, Any] | None) -> None:
    """The finished request in a few lines, then its metrics before and after."""
    done = {
        "request": state.get("id"),
        "status": state.get("status"),
        "run": state.get("run_status"),
        "steps": progress_text({"progress": state.get("progress"), "converged": state.get("converged")}),
        "adapter": state.get("adapter_id"),
    }
    if state.get("error"):
        done["error"] = f"{state['error'].get('code')}: {state['error'].get('message')}"
    print_record(console, {k: v for k, v in done.items() if v is not None})
    rows = metric_rows((metrics or {}).get("before"), (metrics or {}).get("after"))
    if rows:
        print_table(console, rows, ["metric", "before", "after", "change"], title="metrics before and after")
