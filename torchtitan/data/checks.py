"""Checks of user data files, before launch and when reading fails at run time.

A problem with the data is a :class:`DataError`: a ``ConfigError`` (so entry points print it as
one message and exit 2) that also names the file and, where known, the line. The preflight
(``torchtitan.preflight.validate_paths``) decodes the head of every data file with
:func:`check_file`; the dataloader turns a reader's exception into a DataError with
:func:`data_error` (docs/errors.md).
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import IO, Any, cast

from torchtitan.config.errors import ConfigError

HEAD_BYTES = 1 << 20  # the preflight decodes this much of each file
MAX_CHECKED_FILES = 16  # ... of this many files (every file is checked to be non-empty)


class DataError(ConfigError):
    """Bad user data: the config field that points at it, the file and the line where known."""

    def __init__(
        self,
        field: str,
        value: Any,
        rule: str,
        fix: str,
        file: Path | str | None = None,
        line: int | None = None,
    ) -> None:
        self.file, self.line = file, line
        where = ""
        if file is not None:
            where = f"{file}{f', line {line}' if line is not None else ''}: "
        super().__init__(field, value, where + rule, fix)


@dataclass(frozen=True)
class DataSource:
    """Where a dataset's records come from: the config field and value, and the local files
    (empty for a hub dataset)."""

    field: str
    value: str
    files: list[Path] = dataclass_field(default_factory=list)
    text_column: str = "text"


def _open(path: Path) -> IO[bytes]:
    if path.name.endswith(".gz"):
        return cast(IO[bytes], gzip.open(path, "rb"))
    return path.open("rb")


def _json_lines(
    src: DataSource, path: Path, limit: int | None
) -> tuple[int, int | None, str | None]:
    """(records read, first bad line, why) over the first ``limit`` bytes (None: all)."""
    read = records = 0
    with _open(path) as f:
        for number, raw in enumerate(f, start=1):
            read += len(raw)
            if limit is not None and read > limit and records:
                break
            text = raw.strip()
            if not text:
                continue
            try:
                record = json.loads(text)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                return records, number, f"is not a JSON object ({e})"
            if not isinstance(record, dict):
                return records, number, f"is a JSON {type(record).__name__}, not an object"
            if src.text_column not in record:
                keys = sorted(record)[:8]
                return records, number, f"has no {src.text_column!r} field (fields: {keys})"
            records += 1
    return records, None, None


def check_file(src: DataSource, path: Path, limit: int | None = HEAD_BYTES) -> None:
    """``path`` is non-empty and its first records decode and carry the text column."""
    fix = f"fix or remove the file, or point {src.field} at other data"
    try:
        size = path.stat().st_size
    except OSError as e:
        raise DataError(src.field, src.value, f"cannot be read ({e})", fix, path) from None
    if size == 0:
        raise DataError(src.field, src.value, "is empty", fix, path)
    name = path.name.lower()
    try:
        if name.endswith((".jsonl", ".json", ".jsonl.gz", ".json.gz")):
            _check_json(src, path, limit, fix)
        elif name.endswith(".parquet"):
            import pyarrow.parquet as pq

            names = pq.read_schema(path).names
            if src.text_column not in names:
                rule = f"has no {src.text_column!r} column (columns: {names})"
                raise DataError(src.field, src.value, rule, fix, path)
        elif name.endswith((".txt", ".txt.gz")):
            with _open(path) as f:
                head = f.read(limit or -1)
            try:
                head.decode("utf-8")
            except UnicodeDecodeError as e:
                if e.start < len(head) - 4:  # not a character cut at the end of the head
                    line = head[: e.start].count(b"\n") + 1
                    rule = "is not UTF-8 text"
                    raise DataError(src.field, src.value, rule, fix, path, line) from None
            if not head.strip():
                raise DataError(src.field, src.value, "holds only whitespace", fix, path)
    except DataError:
        raise
    except Exception as e:  # a reader's own error (gzip, parquet): name the file
        rule = f"cannot be decoded ({type(e).__name__}: {e})"
        raise DataError(src.field, src.value, rule, fix, path) from None


def _check_json(src: DataSource, path: Path, limit: int | None, fix: str) -> None:
    records, line, why = _json_lines(src, path, limit)
    if line is None:
        if records == 0:
            raise DataError(src.field, src.value, "holds no records", fix, path)
        return
    if line == 1 and path.name.lower().endswith((".json", ".json.gz")):
        # A .json file may be one JSON array of records instead of JSON lines.
        with _open(path) as f:
            try:
                whole = json.load(f)
            except (json.JSONDecodeError, UnicodeDecodeError):
                whole = None
        if (
            isinstance(whole, list)
            and whole
            and all(isinstance(r, dict) and src.text_column in r for r in whole)
        ):
            return
    raise DataError(src.field, src.value, f"the record {why}", fix, path, line)


def check_files(src: DataSource) -> None:
    """Every file non-empty; the heads of the first MAX_CHECKED_FILES decoded."""
    for i, path in enumerate(src.files):
        if i < MAX_CHECKED_FILES:
            check_file(src, path)
        elif path.stat().st_size == 0:
            fix = f"remove the file, or point {src.field} at other data"
            raise DataError(src.field, src.value, "is empty", fix, path)


def data_error(src: DataSource | None, exc: BaseException) -> DataError:
    """A reader failed mid-stream: find the file and line that breaks (decoding each file in
    full), or name the files and the reader's message."""
    if src is None:
        src = DataSource("training.dataset", "?")
    for path in src.files:
        try:
            check_file(src, path, limit=None)
        except DataError as e:
            return e
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    files = ", ".join(str(p) for p in src.files[:3]) or src.value
    return DataError(
        src.field,
        src.value,
        f"reading {files} failed ({type(exc).__name__}: {first})",
        f"check the files {src.field} points at",
    )
