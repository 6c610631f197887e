"""Paired preference, unpaired (KTO), prompt and process-reward datasets, with the char tokenizer.

Character ids: see tests/unit/test_data_sft.py ('a'=16 ... 'z'=41, ' '=100, '</s>'=2, '#'=70,
'+'=78, '-'=80).
"""

from __future__ import annotations

import pytest
import torch

from rlhfkit.data.io import DataError, Row
from rlhfkit.data.preference import (PreferenceDataConfig, PreferenceDataset, UnpairedDataConfig, UnpairedDataset,
                                     kto_mismatched, preference_rows)
from rlhfkit.data.prm import PRMDataConfig, PRMDataset, collate_prm
from rlhfkit.data.prompts import PromptDataConfig, PromptDataset, build_prompt_samples
from rlhfkit.models.tiny import build_tokenizer
from rlhfkit.types import PromptSample

EOS = 2
a, b, c, d, x, y = 16, 17, 18, 19, 39, 40
HASH, PLUS, MINUS = 70, 78, 80


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def rows(*dicts):
    return [Row(r, "prefs.jsonl", k + 1) for k, r in enumerate(dicts)]


def test_pairs_with_prompt_key_and_margin(tok):
    cfg = PreferenceDataConfig(prompt_key="p", input_template="{}:")
    ds = PreferenceDataset(rows({"p": "ab", "chosen": "c", "rejected": "dd", "margin": 0.5}), tok, cfg)
    it = ds[0]
    # prompt "ab:" (3 tokens), chosen "c" + EOS, rejected "dd" + EOS
    assert it.chosen_ids == [a, b, 83, c, EOS] and it.chosen_loss_mask == [0, 0, 0, 1, 1]
    assert it.rejected_ids == [a, b, 83, d, d, EOS] and it.rejected_loss_mask == [0, 0, 0, 1, 1, 1]
    assert it.margin == 0.5
    both = preference_rows([it, it])
    assert [r.input_ids for r in both] == [it.chosen_ids] * 2 + [it.rejected_ids] * 2


def test_pairs_without_prompt_are_whole_texts(tok):
    ds = PreferenceDataset(rows({"chosen": "ab", "rejected": "c"}), tok, PreferenceDataConfig())
    assert ds[0].chosen_ids == [a, b, EOS] and ds[0].chosen_loss_mask == [0, 1, 1]  # token 0 is never predicted
    assert ds[0].margin == 0.0


def test_pairs_as_conversations(tok):
    prompt = [{"role": "user", "content": "x"}]
    conv_c = prompt + [{"role": "assistant", "content": "ab"}]
    conv_r = prompt + [{"role": "assistant", "content": "c"}]
    full = PreferenceDataset(rows({"chosen": conv_c, "rejected": conv_r}), tok,
                             PreferenceDataConfig(apply_chat_template=True))[0]
    keyed = PreferenceDataset(rows({"p": "x", "chosen": "ab", "rejected": "c"}), tok,
                              PreferenceDataConfig(prompt_key="p", apply_chat_template=True))[0]
    assert full == keyed
    # prompt: <|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n = 20 tokens; "ab<|im_end|>" + EOS = 4
    assert full.chosen_loss_mask == [0] * 20 + [1] * 4
    assert tok.decode(full.rejected_ids[20:]) == "c<|im_end|></s>"


def test_pair_errors_and_drops(tok):
    with pytest.raises(DataError, match=r"prefs.jsonl row 1: missing key 'better' \(--chosen_key\)"):
        PreferenceDataset(rows({"chosen": "a", "rejected": "b"}), tok, PreferenceDataConfig(chosen_key="better"))
    with pytest.raises(DataError, match=r"row 1: key 'chosen' \(--chosen_key\) must be a string without"):
        PreferenceDataset(rows({"chosen": [{"role": "assistant", "content": "a"}], "rejected": "b"}), tok,
                          PreferenceDataConfig())
    with pytest.raises(DataError, match=r"row 1: key 'margin' must be a number"):
        PreferenceDataset(rows({"chosen": "a", "rejected": "b", "margin": "big"}), tok, PreferenceDataConfig())
    # chosen fits, rejected's response is cut away entirely: the pair is dropped
    ds = PreferenceDataset(rows({"p": "abc", "chosen": "x", "rejected": "y"}, {"p": "a", "chosen": "x", "rejected": "y"}),
                           tok, PreferenceDataConfig(prompt_key="p", max_len=3))
    assert len(ds) == 1 and ds.num_dropped == 1 and ds[0].chosen_ids == [a, x, EOS]


def test_kto_items_labels_and_mismatched_pairs(tok):
    data = rows({"input": "a", "output": "x", "label": True}, {"input": "bb", "output": "yy", "label": "false"},
                {"input": "c", "output": "d", "label": 0})
    ds = UnpairedDataset(data, tok, UnpairedDataConfig(input_template="{}:"))
    assert [it.label for it in ds] == [True, False, False]
    assert ds[1].input_ids == [b, b, 83, y, y, EOS] and ds[1].loss_mask == [0, 0, 0, 1, 1, 1]
    assert ds[1].prompt_len == 3
    kl = kto_mismatched(ds.items, max_len=64)
    # prompt of item i + response of item i+1
    assert kl[0].input_ids == [a, 83, y, y, EOS] and kl[0].loss_mask == [0, 0, 1, 1, 1]
    assert kl[2].input_ids == [c, 83, x, EOS] and kl[2].loss_mask == [0, 0, 1, 1]
    with pytest.raises(DataError, match=r"row 1: key 'label' \(--label_key\) must be a boolean"):
        UnpairedDataset(rows({"input": "a", "output": "x", "label": "maybe"}), tok, UnpairedDataConfig())


def test_prompt_samples(tok):
    data = [Row({"q": "ab", "ans": 3, "datasource": "math"}, "p.jsonl", 1), Row({"q": "c", "ans": [1]}, "p.jsonl", 2)]
    plain = build_prompt_samples(data, tok, PromptDataConfig(input_key="q", label_key="ans", input_template="Q:{}"))
    assert plain == [  # the row's input as given and its other columns travel along (TRL-shaped rewards read them)
        PromptSample("Q:ab", 3, "math", 0, input="ab", columns={"ans": 3, "datasource": "math"}),
        PromptSample("Q:c", [1], "default", 1, input="c", columns={"ans": [1]})]
    chat = build_prompt_samples(data, tok, PromptDataConfig(input_key="q", apply_chat_template=True))
    assert chat[0].prompt == "<|im_start|>user\nab<|im_end|>\n<|im_start|>assistant\n" and chat[0].label is None
    msgs = [Row({"q": [{"role": "system", "content": "s"}, {"role": "user", "content": "ab"}]}, "p.jsonl", 1)]
    sys_chat = build_prompt_samples(msgs, tok, PromptDataConfig(input_key="q", apply_chat_template=True))
    assert sys_chat[0].prompt.startswith("<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nab")
    with pytest.raises(DataError, match=r"p.jsonl row 1: missing key 'answer' \(--label_key\)"):
        build_prompt_samples(data, tok, PromptDataConfig(input_key="q", label_key="answer"))
    short = PromptDataset(data, tok, PromptDataConfig(input_key="q", max_prompt_len=1))
    assert [s.prompt for s in short] == ["c"] and short.num_dropped == 1


def test_prm_labels_at_placeholders(tok):
    cfg = PRMDataConfig(input_key="input", label_key="value", placeholder_token="#", reward_tokens=["+", "-"])
    ds = PRMDataset(rows({"input": "ab#c#", "value": ["+", "-"]}, {"input": "a#", "value": [0.25]}), tok, cfg)
    assert ds[0].input_ids == [a, b, HASH, c, HASH]
    assert ds[0].labels == [-100, -100, PLUS, -100, MINUS] and not ds[0].soft
    assert ds[1].labels == [-100, 0.25] and ds[1].soft
    cut = PRMDataset(rows({"input": "ab#c#", "value": ["+", "-"]}), tok,
                     PRMDataConfig(placeholder_token="#", reward_tokens=["+", "-"], max_len=4))
    assert cut[0].labels == [-100, -100, PLUS, -100]  # the cut step's label goes with it
    batch, labels = collate_prm([ds[0]], pad_id=0)
    assert batch.loss_mask.tolist() == [[0, 0, 1, 0, 1]] and labels.dtype == torch.long


def test_prm_errors(tok):
    with pytest.raises(DataError, match="--placeholder_token"):
        PRMDataConfig()
    cfg = PRMDataConfig(placeholder_token="#", reward_tokens=["+", "-"])
    with pytest.raises(DataError, match=r"row 1: 2 placeholder tokens '#' \(--placeholder_token\) but 1 labels"):
        PRMDataset(rows({"input": "a#b#", "value": ["+"]}), tok, cfg)
    with pytest.raises(DataError, match=r"row 1: label '\*' is not one of --reward_tokens"):
        PRMDataset(rows({"input": "a#", "value": ["*"]}), tok, cfg)
    with pytest.raises(DataError, match="--placeholder_token 'ки' must be a single token"):
        PRMDataset(rows({"input": "a", "value": []}), tok, PRMDataConfig(placeholder_token="ки"))
