"""Reading dataset files into rows, with errors that name the file, line and field.

Pure Python (no torch), in the contracts layer: the API validates uploads with it, the engine reads with
it. Accepted layouts (CONTRACT.md "Files"):
a JSON array of objects, JSON Lines (one object per line), or lines that each hold a JSON array of rows;
for text datasets also a plain `.txt` file (one document per blank-line-separated paragraph).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from blade_service.contracts.errors import MAX_FAULTS_NAMED

QA_FIELDS: tuple[str, ...] = ("question", "answer")
PERTURBED_FIELDS: tuple[str, ...] = (
    "question",
    "answer",
    "paraphrased_answer",
    "paraphrased_question",
    "perturbed_answer",
)
TEXT_FIELDS: tuple[str, ...] = ("text",)

DatasetKind = Literal["qa", "text"]

MAX_NESTING = 100  # where a too-deep document's error points; rows are flat objects, real files never nest
_SPACE = re.compile(r"[ \t\n\r]*")  # JSON's whitespace
_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}\n]')  # strings (skipped whole), brackets, newlines


class DatasetError(ValueError):
    """A dataset file that cannot be used; the message names file, line and field. `others`: further bad
    rows of the same file, named after the first as `line N: field 'f': ...`; `unreported`: how many more."""

    def __init__(
        self,
        path: str | Path,
        message: str,
        line: int | None = None,
        field: str | None = None,
        *,
        others: Sequence[DatasetError] = (),
        unreported: int = 0,
    ):
        self.path, self.line, self.field, self.message = str(path), line, field, message
        self.others, self.unreported = tuple(others), unreported
        parts = [f"{path}{self._where()}", *(e._where().removeprefix(", ") for e in self.others)]
        if unreported:
            parts.append(f"and {unreported} more")
        super().__init__("; ".join(parts))

    def _where(self) -> str:
        """`, line N: field 'f': message` (what follows the file's name)."""
        line = f", line {self.line}" if self.line is not None else ""
        field = f" field '{self.field}':" if self.field else ""
        return f"{line}:{field} {self.message}"


@dataclass(frozen=True)
class Row:
    """One record and the 1-based line it started on (for error messages)."""

    data: dict[str, Any]
    line: int


# What a dataset file may hold, for an error about a file that is none of them (a .csv, say).
_FORMATS = "a dataset is a JSON array, JSON Lines (.jsonl) or plain text (.txt, rows split by blank lines)"


def _decode(path: Path, raw: bytes) -> str:
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise DatasetError(path, f"not valid UTF-8 (byte offset {exc.start})", line=line) from None


def read_records(path: str | Path, *, raw: bytes | None = None) -> tuple[list[Row], str]:
    """Rows of a JSON / JSON Lines / text file and the layout found.

    Layouts: 'json', 'jsonl', 'json-lines-of-arrays', 'txt'.
    """
    path = Path(path)
    if raw is None:
        if not path.is_file():
            raise DatasetError(path, "no such file")
        raw = path.read_bytes()
    text = _decode(path, raw)
    if not text.strip():
        raise DatasetError(path, "the file is empty")
    if path.suffix == ".txt":
        rows, line = [], 1
        for block in text.split("\n\n"):
            if block.strip():
                rows.append(Row({"text": block.strip()}, line))
            line += block.count("\n") + 2
        return rows, "txt"
    if text.lstrip().startswith("["):
        try:
            if not (rows := _array_rows(path, text)):
                raise DatasetError(path, "no rows found (the file holds an empty JSON array)", line=1)
            return rows, "json"
        except json.JSONDecodeError as exc:
            if not _first_line_is_json(text):  # not one array per line either: the error is the array's
                raise DatasetError(
                    path, f"invalid JSON ({exc.msg}, column {exc.colno})", line=exc.lineno
                ) from None
        except RecursionError:
            raise _too_deep(path, text, 1) from None
    rows = []
    layout = "jsonl"
    for number, line_text in enumerate(text.splitlines(), start=1):
        if not line_text.strip():
            continue
        try:
            item = json.loads(line_text)
        except json.JSONDecodeError as exc:
            hint = "" if path.suffix in (".json", ".jsonl") else f"; {_FORMATS}"
            raise DatasetError(
                path, f"invalid JSON ({exc.msg}, column {exc.colno}){hint}", line=number
            ) from None
        except RecursionError:
            raise _too_deep(path, line_text, number) from None
        except ValueError:  # json's only other refusal: an integer beyond int()'s digit limit
            raise _too_long_integer(path, number) from None
        if isinstance(item, list):
            layout = "json-lines-of-arrays"
            rows.extend(Row(_as_object(path, sub, number), number) for sub in item)
        else:
            rows.append(Row(_as_object(path, item, number), number))
    if not rows:
        raise DatasetError(path, "no rows found")
    return rows, layout


def _array_rows(path: Path, text: str) -> list[Row]:
    """The objects of a file that is one JSON array, each with the line it starts on. JSONDecodeError (at its
    line and column in the file) where the text is not exactly one array."""
    decoder, at, line = json.JSONDecoder(), 0, 1
    rows: list[Row] = []
    i = _after_space(text, text.index("[") + 1)
    if not text.startswith("]", i):
        while True:
            try:
                item, end = decoder.raw_decode(text, i)  # `[1,]` fails here, as in json.loads
            except json.JSONDecodeError:
                raise
            except ValueError:  # json's only other refusal: an integer beyond int()'s digit limit
                raise _too_long_integer(path, line + text.count("\n", at, i)) from None
            line, at = line + text.count("\n", at, i), i
            rows.append(Row(_as_object(path, item, line), line))
            i = _after_space(text, end)
            if text.startswith("]", i):
                break
            if not text.startswith(",", i):
                raise json.JSONDecodeError("Expecting ',' delimiter", text, i)
            i = _after_space(text, i + 1)
    if (rest := _after_space(text, i + 1)) < len(text):
        raise json.JSONDecodeError("Extra data", text, rest)
    return rows


def _after_space(text: str, i: int) -> int:
    """The index of the first character at or after `i` that is not JSON whitespace."""
    match = _SPACE.match(text, i)
    return match.end() if match else i


def _first_line_is_json(text: str) -> bool:
    """Whether the first non-blank line is a JSON value by itself (a file of one array per line)."""
    try:
        json.loads(next(line for line in text.splitlines() if line.strip()))
    except (json.JSONDecodeError, RecursionError):
        return False
    return True


def _too_deep(path: Path, text: str, first_line: int) -> DatasetError:
    """The error for JSON that json.loads gave up on (RecursionError), at the line where nesting passes
    MAX_NESTING; brackets inside strings do not count. Only runs on that error path (it costs ~4x a parse)."""
    depth, line = 0, first_line
    for token in _JSON_TOKEN.finditer(text):
        mark = token.group()
        if mark == "\n":
            line += 1
        elif mark in ("[", "{"):
            depth += 1
            if depth > MAX_NESTING:
                break
        elif mark in ("]", "}"):
            depth -= 1
    return DatasetError(path, f"JSON nested too deeply (more than {MAX_NESTING} levels)", line=line)


def _too_long_integer(path: Path, line: int | None) -> DatasetError:
    limit = sys.get_int_max_str_digits()
    return DatasetError(path, f"a number with more than {limit} digits", line=line)


def _as_object(path: Path, item: Any, line: int) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise DatasetError(path, f"expected a JSON object per row, got {type(item).__name__}", line=line)
    return item


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def validate_rows(path: str | Path, rows: Sequence[Row], fields: Sequence[str]) -> None:
    """Check every row has each field as a non-empty string (`perturbed_answer`: a non-empty string list)."""
    if not rows:
        raise DatasetError(path, "no rows found")
    faults: list[DatasetError] = []  # the first MAX_FAULTS_NAMED bad fields; the rest only counted
    unreported = 0
    for row in rows:
        for field in fields:
            value = row.data.get(field)
            if field == "perturbed_answer":
                texts = value if isinstance(value, list) and value else [None]
                expected = "a non-empty list of strings"
            else:
                texts, expected = [value], "a non-empty string"
            if field not in row.data:
                problem = "missing"
            elif not all(isinstance(t, str) and t.strip() for t in texts):
                problem = f"must be {expected}, got {value!r:.60}"
            elif not all(_is_unicode(str(t)) for t in texts):  # the tokenizer refuses what UTF-8 cannot hold
                problem = "contains a lone surrogate (a \\ud800-\\udfff escape), which is not Unicode text"
            else:
                continue
            if len(faults) == MAX_FAULTS_NAMED:
                unreported += 1
                continue
            faults.append(DatasetError(path, problem, line=row.line, field=field))
    if faults:
        first, *named = faults
        raise DatasetError(path, first.message, first.line, first.field, others=named, unreported=unreported)


def detect_kind(rows: Sequence[Row]) -> DatasetKind:
    """'qa' when rows carry question/answer, 'text' when they carry text."""
    if not rows:
        return "qa"  # validation then reports that there are no rows
    first = rows[0].data
    if "question" in first or "answer" in first:
        return "qa"
    if "text" in first:
        return "text"
    return "qa"  # validation then names the missing field


def load_dataset_rows(
    path: str | Path, *, fields: Sequence[str] | None = None, raw: bytes | None = None
) -> tuple[list[dict[str, Any]], DatasetKind, str]:
    """Read and validate a forget/retain dataset: (rows, kind, layout).

    QA rows need question and answer; text rows need text.
    """
    rows, layout = read_records(path, raw=raw)
    kind = detect_kind(rows)
    validate_rows(path, rows, fields or (QA_FIELDS if kind == "qa" else TEXT_FIELDS))
    return [r.data for r in rows], kind, layout
