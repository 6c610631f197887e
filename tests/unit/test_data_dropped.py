"""Rows left out at load are counted and named once; too few left stops the run; empty prompts are refused.

The character tokenizer gives one token per character, so "Q:abc" is 5 tokens.
"""

from __future__ import annotations

import json

import pytest

from rlhfkit.data.io import DataError, Row
from rlhfkit.data.items import check_cut, check_dropped
from rlhfkit.data.prompts import PromptDataConfig, PromptDataset
from rlhfkit.data.sft import SFTDataConfig, SFTDataset
from rlhfkit.models.tiny import build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def rows(texts, key="q", source="p.jsonl"):
    return [Row({key: t}, source, k + 1) for k, t in enumerate(texts)]


def test_prompts_left_out_are_counted_and_the_first_named(tok):
    # "Q:" + text: 4, 7, 4, 8 tokens; --prompt_max_len 5 leaves out rows 2 and 4
    ds = PromptDataset(rows(["ab", "abcde", "cd", "abcdef"]), tok,
                       PromptDataConfig(input_key="q", input_template="Q:{}", max_prompt_len=5))
    assert [s.prompt for s in ds] == ["Q:ab", "Q:cd"] and ds.num_dropped == 2
    line = check_dropped(ds, 4, "--prompt_data p.jsonl")
    assert line == ("--prompt_data p.jsonl: 2 of 4 rows left out: longer than --prompt_max_len 5 tokens "
                    "(the first: p.jsonl row 2)")


def test_fewer_than_half_left_stops_with_the_reason(tok):
    ds = PromptDataset(rows(["ab", "abcde", "abcdefg"]), tok,
                       PromptDataConfig(input_key="q", input_template="Q:{}", max_prompt_len=5))
    with pytest.raises(DataError, match=r"^--prompt_data p.jsonl: 2 of 3 rows left out: longer than "
                                        r"--prompt_max_len 5 tokens \(the first: p.jsonl row 2\); only 1 rows are "
                                        r"left to train on"):
        check_dropped(ds, 3, "--prompt_data p.jsonl")
    # evaluation data is reported, not stopped, unless nothing is left
    assert check_dropped(ds, 3, "--eval_dataset p.jsonl", training=False).endswith("(the first: p.jsonl row 2)")
    none = PromptDataset(rows(["abcde", "abcdefg"]), tok,
                         PromptDataConfig(input_key="q", input_template="Q:{}", max_prompt_len=5))
    with pytest.raises(DataError, match=r"2 of 2 rows left out: .*; no row is left to train on"):
        check_dropped(none, 2, "--eval_dataset p.jsonl", training=False)


def test_nothing_left_out_says_nothing(tok):
    ds = PromptDataset(rows(["ab"]), tok, PromptDataConfig(input_key="q", max_prompt_len=5))
    assert check_dropped(ds, 1, "--prompt_data p.jsonl") is None


def test_sft_rows_cut_away_name_max_len(tok):
    data = [Row({"q": "hi", "a": "yo"}, "s.jsonl", 1), Row({"q": "a long question", "a": "x"}, "s.jsonl", 2),
            Row({"q": "hi", "a": "ok"}, "s.jsonl", 3)]
    ds = SFTDataset(data, tok, SFTDataConfig(input_key="q", output_key="a", input_template="{}", max_len=6))
    assert len(ds) == 2
    assert check_dropped(ds, 3, "--dataset s.jsonl") == ("--dataset s.jsonl: 1 of 3 rows left out: no token to "
                                                          "train on within --max_len 6 (the first: s.jsonl row 2)")


@pytest.mark.parametrize("text, what", [("", "empty"), ("   \n\t", "only whitespace")])
def test_empty_and_whitespace_prompts_are_refused_with_file_row_and_key(tok, text, what):
    with pytest.raises(DataError, match=rf"^p.jsonl row 2: key 'q' \(--input_key\) is {what}"):
        PromptDataset(rows(["ab", text]), tok, PromptDataConfig(input_key="q", input_template="Q:{}"))


def test_train_ppo_stops_at_load_when_most_prompts_are_too_long(tiny_model_dir, tmp_path, capsys):
    from helpers import write_rl_data

    from rlhfkit.cli import train_ppo

    d = write_rl_data(str(tmp_path), num_prompts=12)
    with open(f"{d}/prompts.jsonl") as f:
        first = json.loads(f.readline())["input"]
    args = ["--pretrain", tiny_model_dir, "--remote_rm_url", f"{d}/reward.py", "--prompt_data", f"{d}/prompts.jsonl",
            "--input_key", "input", "--rollout_batch_size", "2", "--train_batch_size", "2",
            "--micro_train_batch_size", "1", "--generate_max_len", "4", "--prompt_max_len", str(len(first) - 1),
            "--save_path", str(tmp_path / "out"), "--disable_progress", "--device", "cpu"]
    with pytest.raises(SystemExit) as e:
        train_ppo.main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and len(err) == 1, err
    assert err[0].startswith(f"train_ppo: error: --prompt_data {d}/prompts.jsonl: 12 of 12 rows left out: "
                             f"longer than --prompt_max_len {len(first) - 1} tokens (the first: "
                             f"{d}/prompts.jsonl row 1); no row is left to train on"), err


def test_rows_cut_at_max_len_are_counted_once_with_what_they_lose(tok):
    # "hi" + "yo" + EOS: 5 tokens; "hi" + "yoo" + EOS: 6, exactly --max_len 6 (not cut); "hi" + "a long answer":
    # cut, its EOS not trained; "a long question" + "x": no response token left (left out, not cut)
    data = [Row({"q": "hi", "a": "yo"}, "s.jsonl", 1), Row({"q": "hi", "a": "a long answer"}, "s.jsonl", 2),
            Row({"q": "hi", "a": "yoo"}, "s.jsonl", 3), Row({"q": "a long question", "a": "x"}, "s.jsonl", 4),
            Row({"q": "hi", "a": "another long one"}, "s.jsonl", 5)]
    ds = SFTDataset(data, tok, SFTDataConfig(input_key="q", output_key="a", input_template="{}", max_len=6))
    assert (len(ds), ds.num_dropped, ds.num_cut) == (4, 1, 2)
    assert [it.input_ids[-1] == tok.eos_token_id for it in ds] == [True, False, True, False]
    assert check_cut(ds, 5, "--dataset s.jsonl") == ("--dataset s.jsonl: 2 of 5 rows cut at --max_len 6; their end "
                                                      "token not trained (the first: s.jsonl row 2)")
    fits = SFTDataset(data[:1] + data[2:3], tok,
                      SFTDataConfig(input_key="q", output_key="a", input_template="{}", max_len=6))
    assert fits.num_cut == 0 and check_cut(fits, 2, "--dataset s.jsonl") is None
    raw = SFTDataset(data, tok, SFTDataConfig(input_key="q", output_key="a", max_len=6, pretrain_mode=True))
    assert raw.num_cut == 3 and check_cut(raw, 5, "--dataset s.jsonl").endswith(
        "3 of 5 rows cut at --max_len 6; the rest of their text not trained (the first: s.jsonl row 2)")


def test_multiturn_rows_cut_in_a_trained_turn_are_counted(tok):
    convo = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    long = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a much longer answer"}]
    rows_ = [Row({"m": convo}, "c.jsonl", 1), Row({"m": long}, "c.jsonl", 2)]
    full = len(SFTDataset(rows_[:1], tok, SFTDataConfig(input_key="m", multiturn=True, max_len=512))[0])
    ds = SFTDataset(rows_, tok, SFTDataConfig(input_key="m", multiturn=True, max_len=full))
    assert (len(ds), ds.num_cut, ds.first_cut.where) == (2, 1, "c.jsonl row 2")


def test_preference_kto_and_prm_rows_cut_at_max_len_are_counted(tok):
    from rlhfkit.data.preference import PreferenceDataConfig, PreferenceDataset, UnpairedDataConfig, UnpairedDataset
    from rlhfkit.data.prm import PRMDataConfig, PRMDataset

    pairs = [Row({"p": "hi", "c": "yo", "r": "no"}, "p.jsonl", 1),
             Row({"p": "hi", "c": "yo", "r": "a long rejected answer"}, "p.jsonl", 2)]
    ds = PreferenceDataset(pairs, tok, PreferenceDataConfig(prompt_key="p", chosen_key="c", rejected_key="r",
                                                            input_template="{}", max_len=6))
    assert (len(ds), ds.num_cut) == (2, 1)
    assert check_cut(ds, 2, "--dataset p.jsonl") == ("--dataset p.jsonl: 1 of 2 rows cut at --max_len 6; their end "
                                                      "token not trained (the first: p.jsonl row 2)")
    unpaired = [Row({"q": "hi", "a": "a long answer", "l": True}, "k.jsonl", 1),
                Row({"q": "hi", "a": "yo", "l": False}, "k.jsonl", 2)]
    kto = UnpairedDataset(unpaired, tok, UnpairedDataConfig(input_key="q", output_key="a", label_key="l",
                                                            input_template="{}", max_len=6))
    assert (len(kto), kto.num_cut, kto.first_cut.where) == (2, 1, "k.jsonl row 1")
    # PRM: "ab+cd+" with "+" ending each step: BOS + 6 tokens; --max_len 5 cuts the second step's label away
    steps = [Row({"t": "ab+cd+", "v": [1.0, 0.0]}, "r.jsonl", 1), Row({"t": "a+", "v": [1.0]}, "r.jsonl", 2)]
    prm = PRMDataset(steps, tok, PRMDataConfig(input_key="t", label_key="v", placeholder_token="+", max_len=5))
    assert (len(prm), prm.num_cut) == (2, 1)
    assert check_cut(prm, 2, "--dataset r.jsonl").endswith(
        "1 of 2 rows cut at --max_len 5; the labels of their steps after the cut not trained (the first: r.jsonl row 1)")
