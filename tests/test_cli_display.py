"""How the client verbs print tables (`blade_service/cli/display.py`): every cell whole at any width, and a
reader that stops early ends the command quietly."""

from __future__ import annotations

import io
import os
import subprocess
import sys

from rich.console import Console

from blade_service.cli import display

ADAPTER_ID = "ad_" + "a" * 32
REQUEST_ID = "req_" + "b" * 32
ROWS = [
    {"id": ADAPTER_ID, "version": 3, "state": "active", "request_id": REQUEST_ID, "reason": "a\tb\nc"},
    {"id": "ad_short", "version": 4, "state": "disabled", "request_id": None, "reason": "gdpr"},
]
COLUMNS = ["id", "version", "state", "request_id", "reason"]


def _printed(*, terminal: bool, width: int = 80) -> str:
    out = io.StringIO()
    console = Console(file=out, force_terminal=terminal, width=width, color_system=None)
    display.print_table(console, ROWS, COLUMNS, title="later versions")
    return out.getvalue()


def test_off_a_terminal_a_table_is_tab_separated_lines_with_its_column_names_first():
    lines = _printed(terminal=False).splitlines()
    assert lines[0] == "# later versions"
    assert [line.split("\t") for line in lines[1:]] == [
        COLUMNS,
        [ADAPTER_ID, "3", "active", REQUEST_ID, "a b c"],  # a cell's tabs and newlines never split it
        ["ad_short", "4", "disabled", "—", "gdpr"],
    ]


def test_a_terminal_wide_enough_gets_one_table_with_every_cell_whole():
    text = _printed(terminal=True, width=200)
    assert ADAPTER_ID in text and REQUEST_ID in text and "disabled" in text
    header = next(line for line in text.splitlines() if "request_id" in line)
    assert all(c in header for c in COLUMNS)  # one header line: no column squeezed to nothing
    assert max(len(line) for line in text.splitlines()) <= 200


def test_a_narrow_terminal_gets_each_row_as_a_record_instead_of_squeezed_columns():
    text = _printed(terminal=True, width=80)
    assert max(len(line) for line in text.splitlines()) <= 80
    assert text.count("later versions") == 1  # the title once, before the first record
    for value in (ADAPTER_ID, REQUEST_ID, "active", "disabled", "gdpr"):
        assert value in text
    assert sum(line.startswith("│ version") for line in text.splitlines()) == 2  # a line per record


def test_rows_that_come_a_few_at_a_time_line_up_under_one_header():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100, color_system=None)
    columns = ["step", "L_fgt", "converged"]
    display.print_stream_rows(console, [{"step": 1, "L_fgt": 4.385}], columns, title="training dynamics")
    display.print_stream_rows(console, [{"step": 12, "L_fgt": -1.2345e-05, "converged": True}], columns)
    title, header, *rows = out.getvalue().splitlines()
    assert title == "training dynamics" and header.split() == columns and len(rows) == 2
    assert rows[1].split() == ["12", "-1.234e-05", "yes"]
    ends = {len(line) for line in (header, *rows)}  # right-aligned: every column ends where its header does
    assert len(ends) == 1, (header, rows)
    off = io.StringIO()
    display.print_stream_rows(Console(file=off), [{"step": 2, "L_fgt": 0.5}], columns)
    assert off.getvalue() == "2\t0.5\t—\n"  # off a terminal: a tab-separated line, no header again


def test_a_record_off_a_terminal_is_a_field_and_value_line_each():
    out = io.StringIO()
    display.print_record(Console(file=out, width=40), {"status": "succeeded", "steps": 250, "error": None})
    assert out.getvalue().splitlines() == ["status\tsucceeded", "steps\t250", "error\t—"]


def _cli_running(verb: str) -> list[str]:
    """A python command line that runs `blade`'s main with one verb whose body is `verb` (uses `os`)."""
    script = (
        "import argparse, os, sys\n"
        "from blade_service.cli import main as cli\n"
        "def verb(args):\n"
        f"    {verb}\n"
        "parser = argparse.ArgumentParser()\n"
        "parser.set_defaults(func=verb, command='verb')\n"
        "cli.build_parser = lambda: parser\n"
        "sys.exit(cli.main([]))\n"
    )
    return [sys.executable, "-c", script]


def test_a_reader_that_stops_early_ends_the_command_quietly():
    rows = _cli_running("for i in range(200_000): print('row', i)")
    proc = subprocess.Popen(rows, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.read(20).startswith(b"row 0")  # `| head`: read a little, then stop
    proc.stdout.close()
    assert proc.wait(timeout=60) == 141  # what a shell reports for a command ended by SIGPIPE
    assert proc.stderr.read() == b""  # no traceback, no "Exception ignored" at exit


def test_off_a_terminal_the_hub_and_transformers_draw_no_bars():
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    show = _cli_running("print(os.environ.get('HF_HUB_DISABLE_PROGRESS_BARS'))")
    done = subprocess.run(show, capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "1", done.stderr  # its stderr is a pipe


def test_a_converged_request_reads_as_converged_not_as_short_of_its_cap():
    """'38/250' read as a run stopped early; the cap is only a bound once the convergence stop ended it."""
    progress = {"step": 38, "total_steps": 250, "fraction": 1.0}
    assert display.progress_text({"progress": progress, "converged": True}) == "step 38, converged (cap 250)"
    assert display.progress_text({"progress": progress, "converged": None}) == "step 38/250 (100.0%)"
    running = {"step": 12, "total_steps": 250, "fraction": 0.048, "eta_seconds": 126}
    assert (
        display.progress_text({"progress": running, "converged": None}) == "step 12/250 (4.8%) · ETA 2.1 min"
    )
