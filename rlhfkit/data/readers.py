"""Reading one data file into `Row`s, with limits: row size, UTF-8, empty files.

    .jsonl     streamed line by line in binary: a line is read only up to --max_row_bytes (+2),
               so an oversized row is measured by skipping the rest of it, never held whole;
               each line is decoded on its own (row number = line number)
    .json      read and decoded once; a JSON array is parsed one element at a time
               (`JSONDecoder.raw_decode`), which gives each row's extent for the size check and
               its number for errors; a top-level object of columns, or JSON lines
    .parquet / .csv / .arrow   pyarrow tables; row sizes measured only when the table is larger
               than the limit

Errors name the file and the row (not a byte offset): a row over `--max_row_bytes` (with its
size), a row that is not valid UTF-8, invalid JSON, a row that is not an object, and a file with
no rows at all. A JSON escape can spell a lone surrogate (`"\ud800"`: valid JSON, not text any
tokenizer or file can hold), so a row holding one is an error naming the file, row and key too
(`invalid_unicode`; rows in memory are checked the same way, Arrow tables cannot hold one).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, BinaryIO, Iterator

from rlhfkit.data.rows import DataError, Row

DEFAULT_MAX_ROW_BYTES = 1_000_000
FILE_EXTS = (".json", ".jsonl", ".parquet", ".csv", ".arrow")
_WS = re.compile(r"[ \t\r\n]*")
_ESCAPED = re.compile("[\udc80-\udcff]")  # bytes that were not UTF-8 (surrogateescape)
_SURROGATE = re.compile("[\ud800-\udfff]")  # no Unicode text holds one
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # how JSON spells one (pairs too: checked on the values)


def _too_big(path: str, row: int, size: int, max_bytes: int) -> DataError:
    return DataError(f"{path} row {row}: {size} bytes, more than --max_row_bytes {max_bytes} "
                     "(raise the limit or remove the row)")


def _not_utf8(path: str, row: int) -> DataError:
    return DataError(f"{path} row {row}: not valid UTF-8 text")


def _text_bytes(text: str, start: int = 0, end: int | None = None) -> int:
    part = text[start:end]
    if part.isascii():
        return len(part)
    try:
        return len(part.encode("utf-8", "surrogateescape"))
    except UnicodeEncodeError:  # a lone surrogate (check_unicode names it): 3 bytes, as UTF-8 would spell it
        return len(part.encode("utf-8", "surrogatepass"))


def value_bytes(value: Any) -> int:
    """Approximate size of a row's value: text and bytes exactly, 8 per number, recursively."""
    if isinstance(value, str):
        return _text_bytes(value)
    if isinstance(value, (bytes, bytearray)):
        return len(value)
    if isinstance(value, dict):
        return sum(_text_bytes(str(k)) + value_bytes(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return sum(value_bytes(v) for v in value)
    return 8


def invalid_unicode(value: Any, where: str = "") -> str | None:
    """Where in `value` (a row's dict, list or string, walked recursively) a string holds a lone surrogate,
    as `key 'input'` / `key 'messages[0].content'` and the character, else None."""
    if isinstance(value, str):
        m = _SURROGATE.search(value)
        if m is None:
            return None
        return (f"key {where!r} is not valid Unicode text (a lone surrogate \\u{ord(m.group()):04x} at character "
                f"{m.start()})")
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    for k, v in items:
        if isinstance(k, str) and _SURROGATE.search(k):
            return f"a key near {where!r} is not valid Unicode text (a lone surrogate)"
        inner = f"{where}[{k}]" if isinstance(k, int) else f"{where}.{k}" if where else str(k)
        found = invalid_unicode(v, inner)
        if found is not None:
            return found
    return None


def check_unicode(path: str, row: int, rec: Any) -> None:
    """A DataError naming the file, row and key when `rec` holds a lone surrogate."""
    found = invalid_unicode(rec)
    if found is not None:
        raise DataError(f"{path} row {row}: {found}")


def _record(path: str, row: int, rec: Any, raw: str = "") -> Row:
    """`raw`: the row's JSON text; its values are checked for lone surrogates when it has a \\uD8xx-\\uDFxx escape."""
    if not isinstance(rec, dict):
        raise DataError(f"{path} row {row}: expected an object, got {type(rec).__name__}")
    if _SURROGATE_ESCAPE.search(raw):
        check_unicode(path, row, rec)
    return Row(rec, path, row)


def _parse_line(path: str, lineno: int, line: str) -> Row:
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{path} row {lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
    return _record(path, lineno, rec, line)


# ----------------------------------------------------------------------------- JSON lines


def _skip_line(f: BinaryIO) -> int:
    """Read to the end of the current line without keeping it; bytes skipped (newline excluded)."""
    n = 0
    while True:
        chunk = f.readline(1 << 20)
        if not chunk:
            return n
        if chunk.endswith(b"\n"):
            return n + len(chunk.rstrip(b"\r\n"))
        n += len(chunk)


def jsonl_stream(path: str, f: BinaryIO, limit: int, max_bytes: int) -> Iterator[Row]:
    """Rows of a JSON-lines binary stream (row number = line number; blank lines are skipped)."""
    count = lineno = 0
    while count < limit:
        raw = f.readline(max_bytes + 2)  # content + "\r\n" at most
        if not raw:
            return
        lineno += 1
        body = raw.rstrip(b"\r\n")
        if len(body) > max_bytes:
            rest = 0 if raw.endswith(b"\n") else _skip_line(f)
            raise _too_big(path, lineno, len(body) + rest, max_bytes)
        try:
            line = body.decode("utf-8-sig" if lineno == 1 else "utf-8")
        except UnicodeDecodeError:
            raise _not_utf8(path, lineno) from None
        if not line.strip():
            continue
        count += 1
        yield _parse_line(path, lineno, line)


def _jsonl_text(path: str, text: str, limit: int, max_bytes: int, escaped: bool) -> Iterator[Row]:
    """JSON lines held in one decoded string (a .json file); `escaped`: text has non-UTF-8 bytes."""
    count, start, lineno = 0, 0, 0
    while count < limit and start < len(text):
        end = text.find("\n", start)
        end = len(text) if end < 0 else end
        lineno += 1
        line = text[start:end].rstrip("\r")
        start = end + 1
        if len(line) > max_bytes // 4 and _text_bytes(line) > max_bytes:
            raise _too_big(path, lineno, _text_bytes(line), max_bytes)
        if escaped and _ESCAPED.search(line):
            raise _not_utf8(path, lineno)
        if not line.strip():
            continue
        count += 1
        yield _parse_line(path, lineno, line)


# ----------------------------------------------------------------------------- JSON documents


def _array_rows(path: str, text: str, start: int, limit: int, max_bytes: int, escaped: bool) -> Iterator[Row]:
    """Elements of the JSON array starting at `text[start] == "["`, one `raw_decode` each."""
    decoder = json.JSONDecoder()
    i = _WS.match(text, start + 1).end()
    if text.startswith("]", i):
        return
    row = 0
    while row < limit:
        try:
            rec, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError as e:
            raise DataError(f"{path} row {row + 1}: invalid JSON ({e.msg} at line {e.lineno} "
                            f"column {e.colno})") from None
        row += 1
        if end - i > max_bytes // 4 and _text_bytes(text, i, end) > max_bytes:
            raise _too_big(path, row, _text_bytes(text, i, end), max_bytes)
        if escaped and _ESCAPED.search(text, i, end):
            raise _not_utf8(path, row)
        yield _record(path, row, rec, text[i:end] if _SURROGATE_ESCAPE.search(text, i, end) else "")
        i = _WS.match(text, end).end()
        if text.startswith(",", i):
            i = _WS.match(text, i + 1).end()
        elif text.startswith("]", i):
            return
        else:
            raise DataError(f"{path} row {row}: expected ',' or ']' after the row")


def _columns_to_rows(path: str, obj: dict) -> list:
    """A dict of equal-length lists (column layout) becomes a list of row dicts."""
    cols = list(obj.values())
    if not cols or not all(isinstance(c, list) and len(c) == len(cols[0]) for c in cols):
        raise DataError(f"{path}: a top-level object must map column names to equal-length lists; "
                        "use a list of objects or JSON lines instead")
    return [dict(zip(obj.keys(), vals)) for vals in zip(*cols)]


def _json_rows(path: str, limit: int, max_bytes: int) -> Iterator[Row]:
    """A .json file: an array of objects, an object of columns, or JSON lines (read once)."""
    with open(path, "rb") as f:
        data = f.read()
    escaped = False
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:  # keep going so the bad row can be named, not its byte offset
        text, escaped = data.decode("utf-8", "surrogateescape").removeprefix("\ufeff"), True
    del data
    first = _WS.match(text).end()
    if text.startswith("[", first):
        yield from _array_rows(path, text, first, limit, max_bytes, escaped)
        return
    try:
        obj = json.loads(text) if text.startswith("{", first) else None
    except json.JSONDecodeError:
        obj = None  # not one JSON document: read as JSON lines
    if not isinstance(obj, dict):
        yield from _jsonl_text(path, text, limit, max_bytes, escaped)
        return
    if escaped:
        bad = text.count("\n", 0, _ESCAPED.search(text).start()) + 1
        raise DataError(f"{path} line {bad}: not valid UTF-8 text")
    check_all = bool(_SURROGATE_ESCAPE.search(text))
    for i, rec in enumerate(_columns_to_rows(path, obj)[:limit]):
        if value_bytes(rec) > max_bytes:
            raise _too_big(path, i + 1, value_bytes(rec), max_bytes)
        if check_all:
            check_unicode(path, i + 1, rec)
        yield Row(rec, path, i + 1)


def _jsonl_rows(path: str, limit: int, max_bytes: int) -> Iterator[Row]:
    with open(path, "rb") as f:
        yield from jsonl_stream(path, f, limit, max_bytes)


# ----------------------------------------------------------------------------- tables


def table_rows(source: str, records: list[dict], limit: int, max_bytes: int, total_bytes: int,
               check_text: bool = False) -> Iterator[Row]:
    """Rows of already materialised records; sizes are checked only when the whole is larger
    than the limit (`total_bytes`), since no row can be larger than that; `check_text`: strings are
    checked for lone surrogates (Python objects; an Arrow table cannot hold one)."""
    for i, rec in enumerate(records[:limit]):
        if total_bytes > max_bytes:
            size = value_bytes(rec)
            if size > max_bytes:
                raise _too_big(source, i + 1, size, max_bytes)
        if check_text:
            check_unicode(source, i + 1, rec)
        yield Row(rec, source, i + 1)


def _arrow_table_rows(path: str, table: Any, limit: int, max_bytes: int) -> Iterator[Row]:
    part = table.slice(0, min(limit, table.num_rows))
    yield from table_rows(path, part.to_pylist(), limit, max_bytes, part.nbytes)


def _parquet_rows(path: str, limit: int, max_bytes: int) -> Iterator[Row]:
    import pyarrow.parquet as pq

    yield from _arrow_table_rows(path, pq.read_table(path), limit, max_bytes)


def _csv_rows(path: str, limit: int, max_bytes: int) -> Iterator[Row]:
    import pyarrow.csv as pcsv

    yield from _arrow_table_rows(path, pcsv.read_csv(path), limit, max_bytes)


def _arrow_rows(path: str, limit: int, max_bytes: int) -> Iterator[Row]:
    import pyarrow as pa

    with pa.memory_map(path) as src:
        try:
            table = pa.ipc.open_stream(src).read_all()
        except pa.ArrowInvalid:
            src.seek(0)
            table = pa.ipc.open_file(src).read_all()
    yield from _arrow_table_rows(path, table, limit, max_bytes)


_READERS = {".json": _json_rows, ".jsonl": _jsonl_rows, ".parquet": _parquet_rows,
            ".csv": _csv_rows, ".arrow": _arrow_rows}


def check_max_row_bytes(max_bytes: int) -> None:
    if max_bytes < 1:
        raise DataError(f"--max_row_bytes must be >= 1, got {max_bytes}")


def file_rows(path: str, limit: int, max_bytes: int = DEFAULT_MAX_ROW_BYTES) -> list[Row]:
    """Rows of one local file (at most `limit`); a file without any row is an error."""
    check_max_row_bytes(max_bytes)
    ext = os.path.splitext(path)[1].lower()
    if ext not in _READERS:
        raise DataError(f"{path}: unsupported file type {ext!r}; use one of {', '.join(FILE_EXTS)}")
    try:
        rows = list(_READERS[ext](path, limit, max_bytes))
    except DataError:
        raise
    except Exception as e:  # pyarrow / unicode errors: keep the file name in the message
        raise DataError(f"{path}: cannot read ({type(e).__name__}: {e})") from e
    if not rows and limit > 0:
        raise DataError(f"{path}: empty file (no rows)")
    return rows
