"""Data limits: oversized rows, non-UTF-8 rows, empty files, null labels, --max_len beyond the model."""

from __future__ import annotations

import json
import os
import tracemalloc

import pytest

from rlhfkit.data.io import DataError, load_mixture, load_rows
from rlhfkit.data.prompts import PromptDataConfig, build_prompt_samples

OK = json.dumps({"input": "1+1=", "label": "2"})


def lines(path, *rows: str | bytes) -> str:
    with open(path, "wb") as f:
        for r in rows:
            f.write((r if isinstance(r, bytes) else r.encode()) + b"\n")
    return str(path)


def test_oversized_jsonl_row_names_file_row_and_size_without_holding_it(tmp_path):
    big = json.dumps({"input": "x" * 20_000_000, "label": "1"})
    path = lines(tmp_path / "big.jsonl", OK, "", big, OK)  # row = line number: the big row is row 3
    tracemalloc.start()
    with pytest.raises(DataError) as e:
        load_rows(path)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert str(e.value).startswith(f"{path} row 3: {len(big)} bytes, more than --max_row_bytes 1000000")
    assert peak < 5_000_000, peak  # the 20 MB row was skipped through, never read whole
    rows = load_rows(path, max_row_bytes=30_000_000)
    assert [r.row for r in rows] == [1, 3, 4]


@pytest.mark.parametrize("fmt", ["array", "columns", "lines", "parquet"])
def test_oversized_row_in_other_formats(tmp_path, fmt):
    rows = [{"input": "a", "label": "1"}, {"input": "b" * 3000, "label": "2"}, {"input": "c", "label": "3"}]
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = str(tmp_path / "d.parquet")
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path = str(tmp_path / "d.json")
        text = {"array": json.dumps(rows, indent=1),
                "columns": json.dumps({k: [r[k] for r in rows] for k in rows[0]}),
                "lines": "\n".join(json.dumps(r) for r in rows)}[fmt]
        (tmp_path / "d.json").write_text(text)
    with pytest.raises(DataError, match=rf"{path} row 2: 30\d\d bytes, more than --max_row_bytes 2000"):
        load_rows(path, max_row_bytes=2000)
    assert len(load_rows(path, max_row_bytes=4000)) == 3


def test_non_utf8_rows_are_named_by_row_not_byte_offset(tmp_path):
    bad = b'{"input": "caf\xe9", "label": "1"}'
    path = lines(tmp_path / "d.jsonl", OK, OK, bad)
    with pytest.raises(DataError, match=rf"^{path} row 3: not valid UTF-8 text$"):
        load_rows(path)
    path = str(tmp_path / "a.json")
    with open(path, "wb") as f:  # a pretty-printed array: row 2 starts on line 4
        f.write(b'[\n  {"input": "a", "label": "1"},\n\n  ' + bad + b',\n  {"input": "c", "label": "3"}\n]\n')
    with pytest.raises(DataError, match=rf"^{path} row 2: not valid UTF-8 text$"):
        load_rows(path)
    path = lines(tmp_path / "l.json", OK, bad)
    with pytest.raises(DataError, match=rf"^{path} row 2: not valid UTF-8 text$"):
        load_rows(path)


@pytest.mark.parametrize("name,content", [("e.jsonl", b""), ("blank.jsonl", b"\n \n"), ("e.json", b"[]"),
                                          ("e.csv", b"input,label\n")])
def test_empty_files_are_errors_naming_the_file(tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DataError, match=rf"^{path}: (empty file \(no rows\)|cannot read)"):
        load_mixture(f"{lines(tmp_path / 'ok.jsonl', OK)},{path}")
    assert load_rows(str(path), max_samples=0) == []


def test_max_row_bytes_must_be_positive(tmp_path):
    with pytest.raises(DataError, match="--max_row_bytes must be >= 1"):
        load_rows(lines(tmp_path / "d.jsonl", OK), max_row_bytes=0)


def test_null_or_missing_label_names_file_and_row(tmp_path):
    from rlhfkit.models.tiny import build_tokenizer

    tok = build_tokenizer()
    cfg = PromptDataConfig(input_key="input", label_key="label")
    path = lines(tmp_path / "p.jsonl", OK, json.dumps({"input": "2+2=", "label": None}))
    with pytest.raises(DataError, match=rf"^{path} row 2: key 'label' \(--label_key\) is null"):
        build_prompt_samples(load_rows(path), tok, cfg)
    path = lines(tmp_path / "q.jsonl", OK, OK, json.dumps({"input": "2+2="}))
    with pytest.raises(DataError, match=rf"^{path} row 3: missing key 'label' \(--label_key\)"):
        build_prompt_samples(load_rows(path), tok, cfg)
    # without --label_key, labels are not required
    assert build_prompt_samples(load_rows(path), tok, PromptDataConfig(input_key="input"))[2].label is None


def test_max_len_beyond_the_model_positions_names_both_numbers(tiny_model_dir, tmp_path):
    from rlhfkit.cli import ppo_setup, train_ppo, train_sft
    from rlhfkit.cli.common import UsageError

    data = lines(tmp_path / "d.jsonl", json.dumps({"question": "1+1=", "response": "2"}))
    args = train_sft.build_parser().parse(["--pretrain", tiny_model_dir, "--dataset", data, "--max_len", "4096",
                                           "--save_path", str(tmp_path / "o")])
    with pytest.raises(UsageError, match=rf"--max_len 4096 exceeds the model's max_position_embeddings 256 "
                                         rf"\(--pretrain {tiny_model_dir}\)"):
        train_sft.run(args)
    assert not os.path.exists(tmp_path / "o")
    base = ["--pretrain", tiny_model_dir, "--prompt_data", data, "--remote_rm_url", "r.py"]
    with pytest.raises(UsageError, match=r"--prompt_max_len 1024 \+ --generate_max_len 1024 = 2048 \(the default "
                                         r"--max_len\) exceeds the model's max_position_embeddings 256"):
        ppo_setup.resolve_flags(train_ppo.build_parser().parse(base), 1)
    with pytest.raises(UsageError, match="--max_len 300 exceeds the model's max_position_embeddings 256"):
        ppo_setup.resolve_flags(train_ppo.build_parser().parse(
            base + ["--max_len", "300", "--generate_max_len", "8"]), 1)
    args = train_ppo.build_parser().parse(base + ["--prompt_max_len", "200", "--generate_max_len", "56"])
    ppo_setup.resolve_flags(args, 1)  # 256: fits
    assert args.max_len == 256
