"""Row loading: file formats, folders, errors with file/row/key, max_samples, mixtures."""

from __future__ import annotations

import builtins
import json
import os
from collections import Counter

import pytest

from rlhfkit.data.io import DataError, Row, interleave, load_mixture, load_rows, parse_probs

ROWS = [{"question": f"q{i}", "answer": str(i)} for i in range(5)]


def _write_jsonl(path, rows, blank_after: int | None = None) -> str:
    with open(path, "w") as f:
        for i, r in enumerate(rows):
            f.write(json.dumps(r) + "\n")
            if blank_after is not None and i == blank_after:
                f.write("\n")
    return str(path)


def _write(path, fmt: str, rows=ROWS) -> str:
    path = str(path)
    if fmt == "jsonl":
        return _write_jsonl(path, rows)
    if fmt == "json":
        with open(path, "w") as f:
            json.dump(rows, f)
    elif fmt == "json-lines-in-json":
        _write_jsonl(path, rows)
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif fmt == "csv":
        with open(path, "w") as f:
            f.write("question,answer\n" + "".join(f"{r['question']},{r['answer']}\n" for r in rows))
    elif fmt == "arrow":
        import pyarrow as pa
        table = pa.Table.from_pylist(rows)
        with pa.OSFile(path, "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table)
    return path


@pytest.mark.parametrize("fmt,ext", [("json", "json"), ("json-lines-in-json", "json"), ("jsonl", "jsonl"),
                                     ("parquet", "parquet"), ("csv", "csv"), ("arrow", "arrow")])
def test_each_format_loads_with_origin(tmp_path, fmt, ext):
    path = _write(tmp_path / f"data.{ext}", fmt)
    rows = load_rows(path)
    assert [r.data["question"] for r in rows] == [f"q{i}" for i in range(5)]
    assert [r.row for r in rows] == [1, 2, 3, 4, 5]
    assert all(r.source == path for r in rows)
    # csv infers types: the answer column becomes integers there
    answers = [r.data["answer"] for r in rows]
    assert answers == ([0, 1, 2, 3, 4] if fmt == "csv" else ["0", "1", "2", "3", "4"])


def test_missing_key_names_file_row_and_flag(tmp_path):
    rows = ROWS[:3] + [{"prompt": "x"}] + ROWS[3:]
    path = _write_jsonl(tmp_path / "train.jsonl", rows, blank_after=0)  # a blank line 2: the bad row is line 5
    bad = load_rows(path)[3]
    with pytest.raises(DataError) as e:
        bad.get("question", "--input_key")
    assert str(e.value).startswith(f"{path} row 5: missing key 'question' (--input_key)")


def test_row_type_errors_and_invalid_json(tmp_path):
    row = Row({"answer": 3}, "f.jsonl", 2)
    with pytest.raises(DataError, match=r"f.jsonl row 2: key 'answer' \(--output_key\) must be a string, got int"):
        row.get_str("answer", "--output_key")
    path = tmp_path / "bad.jsonl"
    path.write_text('{"a": 1}\n{"a": \n')
    with pytest.raises(DataError, match=r"bad.jsonl row 2: invalid JSON"):
        load_rows(str(path))
    with pytest.raises(DataError, match="no such file"):
        load_rows(str(tmp_path / "nope.jsonl"))


def test_max_samples(tmp_path):
    path = _write(tmp_path / "d.jsonl", "jsonl")
    assert len(load_rows(path, max_samples=3)) == 3
    assert len(load_rows(path, max_samples=100)) == 5
    pq_path = _write(tmp_path / "d.parquet", "parquet")
    assert [r.data["question"] for r in load_rows(pq_path, max_samples=2)] == ["q0", "q1"]
    assert len(load_mixture(f"{path},{pq_path}", max_samples=4)) == 4  # each capped, then the total


def test_folder_splits_and_at_syntax(tmp_path):
    root = tmp_path / "ds"
    (root / "sub").mkdir(parents=True)
    _write(root / "train.jsonl", "jsonl", ROWS[:2])
    _write(root / "test.jsonl", "jsonl", ROWS[2:3])
    _write(root / "sub" / "train-00001.parquet", "parquet", ROWS[3:])
    train = load_rows(str(root), split="train")
    assert sorted(r.data["question"] for r in train) == ["q0", "q1", "q3", "q4"]
    assert [r.data["question"] for r in load_rows(str(root), split="test")] == ["q2"]
    with pytest.raises(DataError, match="no files for split 'validation'"):
        load_rows(str(root), split="validation")
    # name@data_dir: a sub-folder of a local folder
    assert sorted(r.data["question"] for r in load_rows(f"{root}@sub")) == ["q3", "q4"]
    assert sorted(r.source for r in load_rows(f"{root}@sub")) == [os.path.join(str(root), "sub", "train-00001.parquet")] * 2


def test_save_to_disk_folder(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:2]),
                          "test": datasets.Dataset.from_list(ROWS[2:])}).save_to_disk(str(tmp_path / "dict"))
    assert [r.data["question"] for r in load_rows(str(tmp_path / "one"), max_samples=2)] == ["q0", "q1"]
    test = load_rows(str(tmp_path / "dict"), split="test")
    assert [r.data["question"] for r in test] == ["q2", "q3", "q4"] and test[0].where.endswith("[test] row 1")


def test_missing_datasets_names_the_extra(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_datasets(name, *a, **kw):
        if name == "datasets":
            raise ImportError("No module named 'datasets'")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    with pytest.raises(DataError, match=r"pip install rlhfkit\[datasets\]"):
        load_rows("some-org/some-dataset")
    (tmp_path / "saved").mkdir()
    (tmp_path / "saved" / "dataset_dict.json").write_text("{}")
    with pytest.raises(DataError, match=r"pip install rlhfkit\[datasets\]"):
        load_rows(str(tmp_path / "saved"))


def test_bad_probs_name_the_flag():
    with pytest.raises(DataError, match="--dataset_probs has 2 values but --dataset has 3"):
        parse_probs("0.5,0.5", 3)
    with pytest.raises(DataError, match="--dataset_probs must sum to 1"):
        parse_probs("0.5,0.6", 2)
    with pytest.raises(DataError, match="--dataset_probs must be comma-separated numbers"):
        parse_probs("0.5,x", 2)
    assert parse_probs("0.25, 0.75", 2) == [0.25, 0.75]
    assert parse_probs(None, 2) is None


def test_concatenation_without_probs(tmp_path):
    a = _write_jsonl(tmp_path / "a.jsonl", [{"s": "a", "i": i} for i in range(3)])
    b = _write_jsonl(tmp_path / "b.jsonl", [{"s": "b", "i": i} for i in range(2)])
    rows = load_mixture(f"{a}, {b}")
    assert [(r.data["s"], r.data["i"], r.row, r.source) for r in rows] == \
        [("a", 0, 1, a), ("a", 1, 2, a), ("a", 2, 3, a), ("b", 0, 1, b), ("b", 1, 2, b)]


def test_mixture_reproducible_and_honours_probs(tmp_path):
    a = _write_jsonl(tmp_path / "a.jsonl", [{"s": "a", "i": i} for i in range(300)])
    b = _write_jsonl(tmp_path / "b.jsonl", [{"s": "b", "i": i} for i in range(300)])
    r1 = load_mixture(f"{a},{b}", "0.8,0.2", seed=7)
    r2 = load_mixture(f"{a},{b}", "0.8,0.2", seed=7)
    r3 = load_mixture(f"{a},{b}", "0.8,0.2", seed=8)
    key = lambda rows: [(r.data["s"], r.data["i"]) for r in rows]  # noqa: E731
    assert key(r1) == key(r2) and key(r1) != key(r3)
    counts = Counter(r.data["s"] for r in r1)
    # all_exhausted: stop once b (p=0.2, 300 rows) ran out, i.e. after ~1500 draws, ~80% from a
    assert counts["b"] >= 300 and 0.74 < counts["a"] / len(r1) < 0.86
    # each source yields its rows in order, restarting when it runs out
    a_rows = [r.data["i"] for r in r1 if r.data["s"] == "a"]
    assert a_rows[:300] == list(range(300)) and a_rows[300:310] == list(range(10))


def test_interleave_stops_when_all_exhausted():
    src = [[Row({"k": i}, "x", i + 1) for i in range(2)], [Row({"k": 10 + i}, "y", i + 1) for i in range(5)]]
    out = interleave(src, [0.5, 0.5], seed=0)
    ks = [r.data["k"] for r in out]
    assert {10, 11, 12, 13, 14} <= set(ks) and {0, 1} <= set(ks)
    # the last draw is the one that finished the last unfinished source
    last_src = 0 if ks[-1] < 10 else 1
    assert ks[-1] == (1 if last_src == 0 else 14)
    assert interleave(src, [1.0, 0.0], seed=0) == src[0]  # a zero-probability source is never drawn
