"""Row loading: local files, folders, Hugging Face datasets, and dataset mixtures.

Every row remembers where it came from, so that a bad row is reported as

    data/train.jsonl row 17: missing key 'question' (--input_key)

Supported sources (one `--dataset` entry each; entries are comma separated):

    path/to/file.json       a list of objects, or JSON lines
    path/to/file.jsonl      JSON lines (row number = line number)
    path/to/file.parquet    read with pyarrow
    path/to/file.csv        read with pyarrow (types inferred)
    path/to/file.arrow      an Arrow IPC stream or file (what `datasets` writes)
    path/to/folder          every supported file under it (sorted); files named after a split
                            (train*.jsonl, test/...) are filtered by `split`; a folder written by
                            `datasets.Dataset.save_to_disk` is loaded with `datasets.load_from_disk`
    org/name                a Hugging Face dataset (needs `pip install rlhfkit[datasets]`)
    name@data_dir           OpenRLHF's form: a sub-folder of a local folder, or `data_dir=` for the hub

`load_mixture` combines several entries: concatenated without `--dataset_probs`, sampled by
probability with them. Sampling follows `datasets.interleave_datasets(...,
stopping_strategy="all_exhausted")`, which OpenRLHF uses: at each step a source is drawn with its
probability and gives its next row (starting over when it runs out), until every source has run
out at least once.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

FILE_EXTS = (".json", ".jsonl", ".parquet", ".csv", ".arrow")
SPLIT_WORDS = ("train", "test", "validation", "valid", "eval", "dev")
DATASETS_HINT = "pip install rlhfkit[datasets]"


class DataError(ValueError):
    """Bad input data or data flags; the message names the file, row, key or flag."""


@dataclass(frozen=True)
class Row:
    """One input record and its origin (`source` path or dataset name, 1-based `row`)."""

    data: Mapping[str, Any]
    source: str
    row: int

    @property
    def where(self) -> str:
        return f"{self.source} row {self.row}"

    def error(self, message: str) -> DataError:
        """A DataError prefixed with this row's origin."""
        return DataError(f"{self.where}: {message}")

    def get(self, key: str, flag: str) -> Any:
        """`data[key]`; a missing key raises a DataError naming `flag` (e.g. '--input_key')."""
        if key not in self.data:
            have = ", ".join(repr(k) for k in list(self.data)[:8])
            raise self.error(f"missing key {key!r} ({flag}); row has {have}")
        return self.data[key]

    def get_str(self, key: str, flag: str) -> str:
        """`data[key]`, which must be a string."""
        value = self.get(key, flag)
        if not isinstance(value, str):
            raise self.error(f"key {key!r} ({flag}) must be a string, got {type(value).__name__}")
        return value

    def opt(self, key: str, default: Any = None) -> Any:
        """`data[key]` or `default` when absent or None."""
        value = self.data.get(key)
        return default if value is None else value


# ----------------------------------------------------------------------------- file readers


def _cap(max_samples: int | None) -> int:
    return int(1e18) if max_samples is None or max_samples < 0 else int(max_samples)


def _json_rows(path: str, limit: int) -> Iterator[Row]:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        obj = None  # not one JSON document: read as JSON lines
    if obj is None:
        yield from _jsonl_text_rows(path, text, limit)
        return
    if isinstance(obj, dict):
        obj = _columns_to_rows(path, obj)
    if not isinstance(obj, list):
        raise DataError(f"{path}: expected a list of objects or JSON lines, got {type(obj).__name__}")
    for i, rec in enumerate(obj[:limit]):
        if not isinstance(rec, dict):
            raise DataError(f"{path} row {i + 1}: expected an object, got {type(rec).__name__}")
        yield Row(rec, path, i + 1)


def _columns_to_rows(path: str, obj: dict) -> list:
    """A dict of equal-length lists (column layout) becomes a list of row dicts."""
    cols = list(obj.values())
    if not cols or not all(isinstance(c, list) and len(c) == len(cols[0]) for c in cols):
        raise DataError(f"{path}: a top-level object must map column names to equal-length lists; "
                        "use a list of objects or JSON lines instead")
    return [dict(zip(obj.keys(), vals)) for vals in zip(*cols)]


def _jsonl_text_rows(path: str, text: str, limit: int) -> Iterator[Row]:
    count = 0
    for lineno, line in enumerate(text.splitlines(), start=1):
        if count >= limit:
            return
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path} row {lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(rec, dict):
            raise DataError(f"{path} row {lineno}: expected an object, got {type(rec).__name__}")
        count += 1
        yield Row(rec, path, lineno)


def _jsonl_rows(path: str, limit: int) -> Iterator[Row]:
    with open(path, encoding="utf-8") as f:
        yield from _jsonl_text_rows(path, f.read(), limit)


def _table_rows(path: str, table: Any, limit: int) -> Iterator[Row]:
    for i, rec in enumerate(table.slice(0, min(limit, table.num_rows)).to_pylist()):
        yield Row(rec, path, i + 1)


def _parquet_rows(path: str, limit: int) -> Iterator[Row]:
    import pyarrow.parquet as pq

    yield from _table_rows(path, pq.read_table(path), limit)


def _csv_rows(path: str, limit: int) -> Iterator[Row]:
    import pyarrow.csv as pcsv

    yield from _table_rows(path, pcsv.read_csv(path), limit)


def _arrow_rows(path: str, limit: int) -> Iterator[Row]:
    import pyarrow as pa

    with pa.memory_map(path) as src:
        try:
            table = pa.ipc.open_stream(src).read_all()
        except pa.ArrowInvalid:
            src.seek(0)
            table = pa.ipc.open_file(src).read_all()
    yield from _table_rows(path, table, limit)


_READERS = {".json": _json_rows, ".jsonl": _jsonl_rows, ".parquet": _parquet_rows,
            ".csv": _csv_rows, ".arrow": _arrow_rows}


def _file_rows(path: str, limit: int) -> list[Row]:
    ext = os.path.splitext(path)[1].lower()
    if ext not in _READERS:
        raise DataError(f"{path}: unsupported file type {ext!r}; use one of {', '.join(FILE_EXTS)}")
    try:
        return list(_READERS[ext](path, limit))
    except DataError:
        raise
    except Exception as e:  # pyarrow / unicode errors: keep the file name in the message
        raise DataError(f"{path}: cannot read ({type(e).__name__}: {e})") from e


# ----------------------------------------------------------------------------- folders


def _split_of(rel_path: str) -> str | None:
    """The split a file belongs to by its name (train-00000.parquet, test/x.jsonl), else None."""
    parts = rel_path.replace(os.sep, "/").lower().split("/")
    for part in parts[:-1] + [os.path.splitext(parts[-1])[0]]:
        for word in SPLIT_WORDS:
            if part == word or part.startswith((word + "-", word + "_", word + ".")) or \
                    (part.startswith(word) and part[len(word):].isdigit()):
                return word
    return None


def _folder_files(folder: str, split: str | None) -> list[str]:
    files = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        files += [os.path.join(root, n) for n in sorted(names)
                  if os.path.splitext(n)[1].lower() in FILE_EXTS and not n.startswith(".")]
    if not files:
        raise DataError(f"{folder}: no data files ({', '.join(FILE_EXTS)}) in this folder")
    splits = {f: _split_of(os.path.relpath(f, folder)) for f in files}
    if split and any(s is not None for s in splits.values()):
        wanted = [f for f in files if splits[f] == split.lower()]
        if not wanted:
            found = sorted({s for s in splits.values() if s})
            raise DataError(f"{folder}: no files for split {split!r} (--dataset_split); found {found}")
        return wanted
    return files


def _is_saved_dataset(folder: str) -> bool:
    return os.path.exists(os.path.join(folder, "dataset_dict.json")) or (
        os.path.exists(os.path.join(folder, "state.json"))
        and os.path.exists(os.path.join(folder, "dataset_info.json")))


# ----------------------------------------------------------------------------- Hugging Face datasets


def _import_datasets(spec: str) -> Any:
    try:
        import datasets
    except ImportError:
        raise DataError(f"loading {spec!r} needs the `datasets` package, which is not installed: "
                        f"{DATASETS_HINT} (or give a local .json/.jsonl/.parquet/.csv file)") from None
    return datasets


def _hf_rows(ds: Any, source: str, split: str | None, limit: int) -> list[Row]:
    if hasattr(ds, "keys"):  # a DatasetDict: pick the split
        names = list(ds.keys())
        if split in names:
            ds = ds[split]
        elif len(names) == 1:
            ds = ds[names[0]]
        else:
            raise DataError(f"{source}: no split {split!r} (--dataset_split); available: {names}")
        source = f"{source}[{split if split in names else names[0]}]"
    n = min(limit, len(ds))
    records = (ds.select(range(n)) if n < len(ds) else ds).to_list()
    return [Row(rec, source, i + 1) for i, rec in enumerate(records)]


def _load_saved(folder: str, split: str | None, limit: int) -> list[Row]:
    datasets = _import_datasets(folder)
    return _hf_rows(datasets.load_from_disk(folder), folder, split, limit)


def _load_hub(name: str, data_dir: str | None, split: str | None, limit: int) -> list[Row]:
    datasets = _import_datasets(name)
    try:
        ds = datasets.load_dataset(name, data_dir=data_dir)
    except Exception as e:
        raise DataError(f"{name}: not a local file or folder, and loading it as a Hugging Face "
                        f"dataset failed ({type(e).__name__}: {e})") from e
    return _hf_rows(ds, name, split, limit)


# ----------------------------------------------------------------------------- public API


def load_rows(spec: str, split: str | None = "train", max_samples: int | None = None) -> list[Row]:
    """Rows of one `--dataset` entry (a file, a folder, `name@data_dir`, or a hub dataset name).

    `split` picks a split of a folder or Hugging Face dataset (single local files have none);
    at most `max_samples` rows are read (None or negative: all).
    """
    spec = spec.strip()
    if not spec:
        raise DataError("empty dataset entry in --dataset")
    name, _, data_dir = spec.partition("@")
    name, data_dir = name.strip(), (data_dir.strip() or None)
    limit = _cap(max_samples)
    path = os.path.join(name, data_dir) if data_dir and os.path.isdir(name) else name
    if os.path.isfile(path):
        return _file_rows(path, limit)
    if os.path.isdir(path):
        if _is_saved_dataset(path):
            return _load_saved(path, split, limit)
        rows: list[Row] = []
        for f in _folder_files(path, split):
            rows += _file_rows(f, limit - len(rows))
            if len(rows) >= limit:
                break
        return rows
    if os.path.splitext(name)[1].lower() in FILE_EXTS or name.startswith((".", "/", "~")):
        raise DataError(f"{path}: no such file or folder (--dataset)")
    return _load_hub(name, data_dir, split, limit)


def parse_probs(probs: str | Sequence[float] | None, num_datasets: int) -> list[float] | None:
    """Validate `--dataset_probs`: one non-negative number per dataset, summing to 1 (+-1e-3)."""
    if probs is None or (isinstance(probs, str) and not probs.strip()):
        return None
    items = probs.split(",") if isinstance(probs, str) else list(probs)
    try:
        values = [float(p) for p in items]
    except ValueError:
        raise DataError(f"--dataset_probs must be comma-separated numbers, got {probs!r}") from None
    if len(values) != num_datasets:
        raise DataError(f"--dataset_probs has {len(values)} values but --dataset has "
                        f"{num_datasets} entries; give one probability per dataset")
    if any(v < 0 for v in values) or not any(v > 0 for v in values):
        raise DataError(f"--dataset_probs must be non-negative with at least one > 0, got {values}")
    if abs(sum(values) - 1.0) > 1e-3:
        raise DataError(f"--dataset_probs must sum to 1, got {values} (sum {sum(values):g})")
    return values


def interleave(sources: Sequence[Sequence[Row]], probs: Sequence[float], seed: int) -> list[Row]:
    """Sample rows by probability until every source (with p > 0) ran out at least once.

    Same stopping rule as `datasets.interleave_datasets(stopping_strategy="all_exhausted")`:
    a source that runs out starts over (its rows repeat), so small sources are oversampled.
    """
    rng = random.Random(seed)
    live = [i for i, (src, p) in enumerate(zip(sources, probs)) if p > 0 and len(src) > 0]
    if not live:
        return []
    weights = [probs[i] for i in live]
    pos = {i: 0 for i in live}
    exhausted: set[int] = set()
    out: list[Row] = []
    while len(exhausted) < len(live):
        i = rng.choices(live, weights=weights)[0]
        out.append(sources[i][pos[i]])
        pos[i] += 1
        if pos[i] == len(sources[i]):
            exhausted.add(i)
            pos[i] = 0
    return out


def load_mixture(specs: str | Sequence[str], probs: str | Sequence[float] | None = None,
                 split: str | None = "train", max_samples: int | None = None,
                 seed: int = 42) -> list[Row]:
    """Rows of several comma-separated datasets (`--dataset`, `--dataset_probs`).

    Each dataset is capped at `max_samples` rows, then they are concatenated (no probs) or
    interleaved by probability (`interleave`), and the result is capped at `max_samples` again,
    as OpenRLHF's `blending_datasets` + `select(range(max_samples))` do.
    """
    if specs is None or (isinstance(specs, str) and not specs.strip()):
        raise DataError("no dataset given (--dataset)")
    names = [s for s in (specs.split(",") if isinstance(specs, str) else specs) if s.strip()]
    weights = parse_probs(probs, len(names))
    sources = [load_rows(n, split=split, max_samples=max_samples) for n in names]
    rows = [r for src in sources for r in src] if weights is None else interleave(sources, weights, seed)
    return rows[:_cap(max_samples)]
