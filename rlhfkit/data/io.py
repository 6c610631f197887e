"""Row loading: local files, folders, Hugging Face datasets, and dataset mixtures.

Every row remembers where it came from (rows.py), so that a bad row is reported as

    data/train.jsonl row 17: missing key 'question' (--input_key)

Files are read by readers.py, which also enforces `--max_row_bytes` (default 1 MB), UTF-8 and
non-empty files, naming file and row.

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
    RowSource(rows)         rows already in memory (the Python API): a list of dicts or a
                            `datasets.Dataset` / `DatasetDict`; nothing is written to disk, and the
                            rows take the same path as a file's (row limits, --max_samples, errors
                            naming `source row N`)

`load_mixture` combines several entries: concatenated without `--dataset_probs`, sampled by
probability with them. Sampling follows `datasets.interleave_datasets(...,
stopping_strategy="all_exhausted")`, which OpenRLHF uses: at each step a source is drawn with its
probability and gives its next row (starting over when it runs out), until every source has run
out at least once.
"""

from __future__ import annotations

import os
import random
from typing import Any, Sequence

from rlhfkit.data.readers import DEFAULT_MAX_ROW_BYTES, FILE_EXTS, check_max_row_bytes, file_rows, table_rows
from rlhfkit.data.rows import DataError, Row

__all__ = ["DataError", "Row", "RowSource", "DEFAULT_MAX_ROW_BYTES", "FILE_EXTS", "load_rows", "load_mixture",
           "parse_probs", "interleave"]

SPLIT_WORDS = ("train", "test", "validation", "valid", "eval", "dev")
DATASETS_HINT = "pip install rlhfkit[datasets]"


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


def _cap(max_samples: int | None) -> int:
    return int(1e18) if max_samples is None or max_samples < 0 else int(max_samples)


def _hf_rows(ds: Any, source: str, split: str | None, limit: int, max_bytes: int) -> list[Row]:
    if hasattr(ds, "keys"):  # a DatasetDict: pick the split
        names = list(ds.keys())
        if split in names:
            ds = ds[split]
        elif len(names) == 1:
            ds = ds[names[0]]
        else:
            raise DataError(f"{source}: no split {split!r} (--dataset_split); available: {names}")
        source = f"{source}[{split if split in names else names[0]}]"
    if len(ds) == 0 and limit > 0:
        raise DataError(f"{source}: empty dataset (no rows)")
    n = min(limit, len(ds))
    part = ds.select(range(n)) if n < len(ds) else ds
    total = getattr(getattr(part, "data", None), "nbytes", max_bytes + 1)
    return list(table_rows(source, part.to_list(), limit, max_bytes, total))


def _load_saved(folder: str, split: str | None, limit: int, max_bytes: int) -> list[Row]:
    datasets = _import_datasets(folder)
    return _hf_rows(datasets.load_from_disk(folder), folder, split, limit, max_bytes)


def _load_hub(name: str, data_dir: str | None, split: str | None, limit: int, max_bytes: int) -> list[Row]:
    datasets = _import_datasets(name)
    try:
        ds = datasets.load_dataset(name, data_dir=data_dir)
    except Exception as e:
        raise DataError(f"{name}: not a local file or folder, and loading it as a Hugging Face "
                        f"dataset failed ({type(e).__name__}: {e})") from e
    return _hf_rows(ds, name, split, limit, max_bytes)


# ----------------------------------------------------------------------------- rows in memory


def _is_split_dict(data: Any) -> bool:
    """A `datasets.DatasetDict` (or a dict of Datasets): split name -> table."""
    return isinstance(data, dict) and bool(data) and all(hasattr(v, "to_list") for v in data.values())


class RowSource:
    """Rows given in memory, usable wherever a `--dataset` entry is: a list (or tuple) of dicts, a
    dict of equally long column lists, or a Hugging Face `datasets.Dataset` / `DatasetDict`
    (`split` picks from a DatasetDict).
    `name` is what errors and logs call it (`train_dataset row 3: missing key 'input'`)."""

    def __init__(self, data: Any, name: str = "rows") -> None:
        if isinstance(data, RowSource):
            data, name = data.data, name or data.name
        if isinstance(data, dict) and not _is_split_dict(data):  # columns: {"input": [...], "output": [...]}
            lengths = {len(v) if isinstance(v, (list, tuple)) else -1 for v in data.values()}
            if len(lengths) != 1 or -1 in lengths:
                raise DataError(f"{name}: a dict of columns needs lists of one length, got lengths {sorted(lengths)}")
            data = [dict(zip(data, values)) for values in zip(*data.values())]
        if not (hasattr(data, "to_list") or isinstance(data, (list, tuple)) or _is_split_dict(data)):
            raise DataError(f"{name}: expected a list of dicts or a datasets.Dataset, got {type(data).__name__}")
        self.data, self.name = data, name

    def __len__(self) -> int:
        if _is_split_dict(self.data):  # DatasetDict
            return sum(len(v) for v in self.data.values())
        return len(self.data)

    def __str__(self) -> str:
        return f"{self.name} ({len(self)} rows in memory)"

    __repr__ = __str__

    def rows(self, split: str | None, limit: int, max_bytes: int) -> list[Row]:
        if not isinstance(self.data, (list, tuple)):
            return _hf_rows(self.data, self.name, split, limit, max_bytes)
        if not self.data and limit > 0:
            raise DataError(f"{self.name}: empty dataset (no rows)")
        records = list(self.data[:limit])
        for i, rec in enumerate(records):
            if not isinstance(rec, dict):
                raise DataError(f"{self.name} row {i + 1}: expected a dict, got {type(rec).__name__}")
        return list(table_rows(self.name, records, limit, max_bytes, max_bytes + 1, check_text=True))


# ----------------------------------------------------------------------------- public API


def load_rows(spec: str | RowSource, split: str | None = "train", max_samples: int | None = None,
              max_row_bytes: int = DEFAULT_MAX_ROW_BYTES) -> list[Row]:
    """Rows of one `--dataset` entry (a file, a folder, `name@data_dir`, or a hub dataset name).

    `split` picks a split of a folder or Hugging Face dataset (single local files have none);
    at most `max_samples` rows are read (None or negative: all). A row larger than
    `max_row_bytes` (--max_row_bytes), a non-UTF-8 row and a file without rows are errors
    naming the file and row (readers.py).
    """
    check_max_row_bytes(max_row_bytes)
    if isinstance(spec, RowSource):
        return spec.rows(split, _cap(max_samples), max_row_bytes)
    spec = spec.strip()
    if not spec:
        raise DataError("empty dataset entry in --dataset")
    name, _, data_dir = spec.partition("@")
    name, data_dir = name.strip(), (data_dir.strip() or None)
    limit = _cap(max_samples)
    path = os.path.join(name, data_dir) if data_dir and os.path.isdir(name) else name
    if os.path.isfile(path):
        return file_rows(path, limit, max_row_bytes)
    if os.path.isdir(path):
        if _is_saved_dataset(path):
            return _load_saved(path, split, limit, max_row_bytes)
        rows: list[Row] = []
        for f in _folder_files(path, split):
            rows += file_rows(f, limit - len(rows), max_row_bytes)
            if len(rows) >= limit:
                break
        return rows
    if os.path.splitext(name)[1].lower() in FILE_EXTS or name.startswith((".", "/", "~")):
        raise DataError(f"{path}: no such file or folder (--dataset)")
    return _load_hub(name, data_dir, split, limit, max_row_bytes)


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


def load_mixture(specs: str | RowSource | Sequence[str | RowSource], probs: str | Sequence[float] | None = None,
                 split: str | None = "train", max_samples: int | None = None,
                 seed: int = 42, max_row_bytes: int = DEFAULT_MAX_ROW_BYTES) -> list[Row]:
    """Rows of several comma-separated datasets (`--dataset`, `--dataset_probs`).

    Each dataset is capped at `max_samples` rows, then they are concatenated (no probs) or
    interleaved by probability (`interleave`), and the result is capped at `max_samples` again,
    as OpenRLHF's `blending_datasets` + `select(range(max_samples))` do.
    """
    if specs is None or (isinstance(specs, str) and not specs.strip()):
        raise DataError("no dataset given (--dataset)")
    if isinstance(specs, RowSource):
        specs = [specs]
    names = [s for s in (specs.split(",") if isinstance(specs, str) else specs)
             if isinstance(s, RowSource) or s.strip()]
    weights = parse_probs(probs, len(names))
    sources = [load_rows(n, split=split, max_samples=max_samples, max_row_bytes=max_row_bytes) for n in names]
    rows = [r for src in sources for r in src] if weights is None else interleave(sources, weights, seed)
    return rows[:_cap(max_samples)]
