"""Data limits: oversized rows, non-UTF-8 rows, empty files, null labels, --max_len beyond the model."""

from __future__ import annotations

import json
import os
import tracemalloc

import pytest

from rlhfkit.data.io import DataError, load_mixture, load_rows
from rlhfkit.data.prompts import PromptDataConfig, PromptDataset, build_prompt_samples

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
    from rlhfkit.cli import train_ppo, train_sft
    from rlhfkit.rl_run.resolve import resolve
    from rlhfkit.cli.common import UsageError

    data = lines(tmp_path / "d.jsonl", json.dumps({"question": "1+1=", "response": "2"}))
    args = train_sft.build_parser().parse(["--pretrain", tiny_model_dir, "--dataset", data, "--max_len", "4096",
                                           "--save_path", str(tmp_path / "o")])
    with pytest.raises(UsageError, match=rf"--max_len 4096 exceeds the model's max_position_embeddings 256 "
                                         rf"\(--pretrain {tiny_model_dir}\)"):
        train_sft.run(args)
    assert not os.path.exists(tmp_path / "o")
    (tmp_path / "r.py").write_text("def reward_func(queries, prompts, labels):\n    return [0.0] * len(queries)\n")
    base = ["--pretrain", tiny_model_dir, "--prompt_data", data, "--remote_rm_url", str(tmp_path / "r.py")]
    with pytest.raises(UsageError, match=r"--prompt_max_len 1024 \+ --generate_max_len 1024 = 2048 \(the default "
                                         r"--max_len\) exceeds the model's max_position_embeddings 256"):
        resolve(train_ppo.build_parser().parse(base), 1)
    with pytest.raises(UsageError, match="--max_len 300 exceeds the model's max_position_embeddings 256"):
        resolve(train_ppo.build_parser().parse(
            base + ["--max_len", "300", "--generate_max_len", "8"]), 1)
    args = resolve(train_ppo.build_parser().parse(base + ["--prompt_max_len", "200", "--generate_max_len", "56"]),
                   1)  # 256: fits
    assert args.max_len == 256


# ----------------------------------------------------------------------------- issue 42.7: bad rows


def test_a_lone_surrogate_is_an_error_naming_file_row_and_key(tmp_path):
    from rlhfkit.data.io import RowSource

    bad = '{"input": "1+1=\\ud800", "label": "2"}'  # valid JSON, not text: json.loads gives a lone surrogate
    path = lines(tmp_path / "d.jsonl", OK, OK, bad)
    with pytest.raises(DataError, match=rf"^{path} row 3: key 'input' is not valid Unicode text \(a lone surrogate "
                                        r"\\ud800 at character 4\)$"):
        load_rows(path)
    path = str(tmp_path / "a.json")  # an array, a nested key
    with open(path, "w") as f:
        f.write('[{"messages": [{"role": "user", "content": "ok"}]},\n'
                ' {"messages": [{"role": "user", "content": "\\udc00x"}]}]')
    with pytest.raises(DataError, match=rf"^{path} row 2: key 'messages\[0\]\.content' is not valid Unicode"):
        load_rows(path)
    path = str(tmp_path / "c.json")  # columns
    with open(path, "w") as f:
        f.write('{"input": ["a", "b\\udfff"], "label": ["1", "2"]}')
    with pytest.raises(DataError, match=rf"^{path} row 2: key 'input' is not valid Unicode"):
        load_rows(path)
    with pytest.raises(DataError, match=r"^mine row 1: key 'input' is not valid Unicode"):
        load_rows(RowSource([{"input": "\ud800"}], "mine"))
    pair = lines(tmp_path / "ok.jsonl", '{"input": "\\ud83d\\ude00", "label": "1"}')  # an escaped pair is text
    assert load_rows(pair)[0].data["input"] == "\U0001f600"


@pytest.mark.parametrize("value", ["\u200b\u200b\u200b", "\u200b \ufeff\u2060\n", "\x00\u200d",
                                   [{"role": "user", "content": "\u200b"}]])
def test_a_prompt_of_invisible_characters_counts_as_empty(tmp_path, value):
    from rlhfkit.models.tiny import build_tokenizer

    path = lines(tmp_path / "p.jsonl", OK, json.dumps({"input": value, "label": "1"}))
    cfg = PromptDataConfig(input_key="input", label_key="label", apply_chat_template=isinstance(value, list))
    with pytest.raises(DataError, match=rf"^{path} row 2: key 'input' \(--input_key\) is only invisible characters "
                                        r"\(zero-width spaces, format or control characters\): a prompt needs text"):
        build_prompt_samples(load_rows(path), build_tokenizer(), cfg)
    path = lines(tmp_path / "q.jsonl", json.dumps({"input": "\u200b1+1=", "label": "2"}))
    assert len(build_prompt_samples(load_rows(path), build_tokenizer(), cfg.__class__(input_key="input"))) == 1


@pytest.fixture()
def tokenized_lengths(monkeypatch):
    """The tiny tokenizer, and the length of every text it is asked to encode."""
    from rlhfkit.models.tiny import build_tokenizer

    tok, seen = build_tokenizer(), []
    real = type(tok).__call__

    def spy(self, text, *args, **kw):
        seen.append(len(text) if isinstance(text, str) else sum(map(len, text)))
        return real(self, text, *args, **kw)

    monkeypatch.setattr(type(tok), "__call__", spy)
    return tok, seen


HUGE = 10_000_000


def test_a_huge_rl_prompt_is_measured_by_its_head(tmp_path, tokenized_lengths):
    tok, seen = tokenized_lengths
    path = lines(tmp_path / "p.jsonl", OK, json.dumps({"input": "12+" * (HUGE // 3), "label": "1"}), OK, OK)
    ds = PromptDataset(load_rows(path, max_row_bytes=2 * HUGE), tok, PromptDataConfig(max_prompt_len=16))
    assert len(ds) == 3 and ds.num_dropped == 1 and ds.first_dropped.row == 2
    assert max(seen) < 10_000, max(seen)  # never the 10 MB text


@pytest.mark.parametrize("mode", ["response", "prompt", "pretrain", "multiturn"])
def test_a_huge_sft_row_is_encoded_only_as_far_as_the_cut(tmp_path, tokenized_lengths, mode):
    from rlhfkit.data.sft import SFTDataConfig, SFTDataset
    from rlhfkit.data.templates import encode

    tok, seen = tokenized_lengths
    big = "7 8 9 " * (HUGE // 6)
    row = {"prompt": big if mode == "prompt" else "1+1=", "response": big if mode != "prompt" else "2",
           "chat": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": big}]}
    cfg = {"response": dict(input_key="prompt", output_key="response"),
           "prompt": dict(input_key="prompt", output_key="response"),
           "pretrain": dict(input_key="response", pretrain_mode=True),
           "multiturn": dict(input_key="chat", multiturn=True)}[mode]
    path = lines(tmp_path / "s.jsonl", json.dumps(row))
    ds = SFTDataset(load_rows(path, max_row_bytes=3 * HUGE), tok, SFTDataConfig(max_len=32, **cfg))
    assert max(seen) < 10_000, max(seen)
    if mode == "prompt":
        assert len(ds) == 0 and ds.num_dropped == 1  # nothing of the response fits
        return
    (item,) = ds.items
    assert len(item.input_ids) == 32 and any(item.loss_mask)
    if mode == "response":  # the ids of the whole text, cut (a character tokenizer: a prefix's ids are its ids)
        assert item.input_ids == (encode(tok, "1+1=", start=True) + encode(tok, big[:100]))[:32]
    if mode == "pretrain":
        assert item.input_ids == encode(tok, big[:100], start=True)[:32]


def test_encode_head_gives_encode_s_ids_up_to_the_limit_on_a_bpe_tokenizer():
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from rlhfkit.data.templates import encode, encode_head

    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefgh") for _ in range(rng.randint(1, 12))) for _ in range(300)]
    corpus = [" ".join(rng.choices(words, k=40)) for _ in range(200)]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=600,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=core)
    texts = [" ".join(rng.choices(words, k=3000)), "".join(rng.choices(words, k=3000)),  # one 20k-char word
             "  \n ".join(rng.choices(words, k=2000)) + " caf\u00e9 \U0001f600" * 50, "short"]
    for text in texts:
        full = encode(tok, text)
        for limit in (0, 1, 7, 64, 300, len(full) + 5):
            head = encode_head(tok, text, limit)
            assert head[:limit + 1] == full[:limit + 1], (text[:40], limit)
        assert encode_head(tok, text, None) == full
