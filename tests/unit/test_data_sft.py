"""SFT items and templates, with the character tokenizer (one token per character).

Character ids of the tiny tokenizer, worked out from its vocabulary order: 6 specials
(<pad>=0 <s>=1 </s>=2 <unk>=3 <|im_start|>=4 <|im_end|>=5), then string.printable:
digits 6-15, 'a'-'z' 16-41, 'A'-'Z' 42-67, punctuation from '!'=68 (so ':'=83), ' '=100, '\\n'=102.
"""

from __future__ import annotations

import pytest

from rlhfkit.data.io import DataError, Row
from rlhfkit.data.sft import SFTDataConfig, SFTDataset
from rlhfkit.data.templates import check_input_template, set_chat_template
from rlhfkit.models.tiny import build_tokenizer

EOS, IM_START, IM_END, NL, SP = 2, 4, 5, 102, 100
U, COLON, A, h, i, y, o = 62, 83, 42, 23, 24, 40, 30


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def rows(*dicts, source="data/train.jsonl"):
    return [Row(d, source, k + 1) for k, d in enumerate(dicts)]


def sft(tok, data, **cfg):
    return SFTDataset(rows(*data), tok, SFTDataConfig(**cfg))


def test_prompt_response_mask_by_hand(tok):
    ds = sft(tok, [{"q": "hi", "a": "yo"}], input_key="q", output_key="a", input_template="U:{} A:")
    item = ds[0]
    # "U:hi A:" = 7 prompt tokens, "yo" = 2 response tokens, then EOS
    assert item.input_ids == [U, COLON, h, i, SP, A, COLON, y, o, EOS]
    assert item.loss_mask == [0, 0, 0, 0, 0, 0, 0, 1, 1, 1]
    assert ds.num_dropped == 0


def test_truncation_and_drop_count(tok):
    data = [{"q": "hi", "a": "yo"}]
    cut = sft(tok, data, input_key="q", output_key="a", input_template="U:{} A:", max_len=8)
    assert cut[0].input_ids == [U, COLON, h, i, SP, A, COLON, y] and cut[0].loss_mask == [0] * 7 + [1]
    gone = sft(tok, data * 3, input_key="q", output_key="a", input_template="U:{} A:", max_len=7)
    assert len(gone) == 0 and gone.num_dropped == 3


def test_trailing_newline_stripped_and_no_double_eos(tok):
    ds = sft(tok, [{"q": "hi", "a": "yo\n\n"}, {"q": "hi", "a": "yo</s>"}], input_key="q", output_key="a")
    assert ds[0].input_ids == [h, i, y, o, EOS] and ds[0].loss_mask == [0, 0, 1, 1, 1]
    assert ds[1].input_ids == [h, i, y, o, EOS]


def test_chat_template_prompt_response(tok):
    ds = sft(tok, [{"q": "hi", "a": "yo"}], input_key="q", output_key="a", apply_chat_template=True,
             input_template="ignored {}")
    item = ds[0]
    # <|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n = 1+4+1+2+1+1 + 1+9+1 = 21 tokens
    assert item.loss_mask == [0] * 21 + [1] * 4
    assert tok.decode([t for t, m in zip(item.input_ids, item.loss_mask) if m]) == "yo<|im_end|></s>"
    assert tok.decode(item.input_ids[:21]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_chat_conversation_without_output_key(tok):
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    a = sft(tok, [{"input": conv}], apply_chat_template=True)[0]
    b = sft(tok, [{"q": "hi", "a": "yo"}], input_key="q", output_key="a", apply_chat_template=True)[0]
    assert a == b


def test_multiturn_masks_cover_exactly_assistant_turns(tok):
    conv = [{"role": "system", "content": "s"}, {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"},
            {"role": "assistant", "content": "d"}]
    item = sft(tok, [{"messages": conv}], input_key="messages", multiturn=True)[0]
    # system 11, user 9, gen prompt 11, "b<|im_end|>\n" 3, user 9, gen prompt 11, "d<|im_end|>" + EOS 3
    assert len(item.input_ids) == 57
    ones = [k for k, m in enumerate(item.loss_mask) if m]
    assert ones == [31, 32, 33, 54, 55, 56]
    assert tok.decode(item.input_ids[31:34]) == "b<|im_end|>\n"
    assert tok.decode(item.input_ids[54:57]) == "d<|im_end|></s>"
    # everything else is the conversation rendered by the template
    assert tok.decode(item.input_ids[:56]) == tok.apply_chat_template(conv, tokenize=False).rstrip("\n")


def test_multiturn_output_key_appends_final_turn(tok):
    conv = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    full = conv + [{"role": "assistant", "content": "d"}]
    a = sft(tok, [{"input": conv, "output": "d"}], output_key="output", multiturn=True)[0]
    b = sft(tok, [{"input": full}], multiturn=True)[0]
    assert a == b


def test_multiturn_needs_a_chat_template(tok):
    bare = build_tokenizer()
    bare.chat_template = None
    with pytest.raises(DataError, match="--multiturn needs a chat template"):
        sft(bare, [{"input": [{"role": "user", "content": "a"}]}], multiturn=True)
    # --tokenizer_chat_template gives one
    tmpl = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}" \
           "{% if add_generation_prompt %}[assistant]{% endif %}"
    conv = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    item = sft(bare, [{"input": conv}], multiturn=True, tokenizer_chat_template=tmpl)[0]
    assert tok.decode(item.input_ids) == "[user]a[assistant]b</s>"
    assert item.loss_mask == [0] * 18 + [1, 1]


def test_pretrain_mode_masks_all(tok):
    ds = sft(tok, [{"text": "abc"}], input_key="text", pretrain_mode=True, input_template="X{}")
    assert ds[0].input_ids == [16, 17, 18]  # no template, no EOS
    assert ds[0].loss_mask == [0, 1, 1]  # every token with a predecessor
    cut = sft(tok, [{"text": "abcdef"}], input_key="text", pretrain_mode=True, max_len=4)
    assert cut[0].input_ids == [16, 17, 18, 19] and cut[0].loss_mask == [0, 1, 1, 1]


def test_wrong_types_and_missing_keys_are_reported(tok):
    with pytest.raises(DataError, match=r"data/train.jsonl row 2: key 'a' must be a string, got int"):
        sft(tok, [{"q": "x", "a": "y"}, {"q": "x", "a": 3}], input_key="q", output_key="a")
    with pytest.raises(DataError, match=r"data/train.jsonl row 1: missing key 'question' \(--input_key\)"):
        sft(tok, [{"q": "x", "a": "y"}], input_key="question", output_key="a")
    with pytest.raises(DataError, match=r"row 1: key 'q' is a list; chat messages need --apply_chat_template"):
        sft(tok, [{"q": [{"role": "user", "content": "x"}], "a": "y"}], input_key="q", output_key="a")
    with pytest.raises(DataError, match=r"row 1: key 'input' must be a string or a non-empty list of chat"):
        sft(tok, [{"input": 5}], multiturn=True)


def test_config_errors_name_flags():
    with pytest.raises(DataError, match="--input_template must contain"):
        SFTDataConfig(output_key="a", input_template="no placeholder")
    with pytest.raises(DataError, match="--output_key"):
        SFTDataConfig()
    with pytest.raises(DataError, match="--multiturn and --pretrain_mode"):
        SFTDataConfig(multiturn=True, pretrain_mode=True)
    with pytest.warns(UserWarning, match="literal backslash-n"):
        check_input_template("User: {}\\nAssistant: ")


def test_tokenizer_chat_template_from_file(tok, tmp_path):
    t = build_tokenizer()
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    set_chat_template(t, str(path))
    assert t.apply_chat_template([{"role": "user", "content": "ab"}], tokenize=False) == "ab"
    with pytest.raises(DataError, match="--tokenizer_chat_template"):
        set_chat_template(t, str(tmp_path / "missing.jinja"))


def test_empty_input_template_is_no_template():
    """OpenRLHF's rejection sampling script passes --input_template "" to train_sft: the inputs are
    already formatted prompts and are used as they are (OpenRLHF skips a falsy template)."""
    tok = build_tokenizer()
    assert check_input_template("") is None
    rows = [{"q": "U:hi A:", "a": "yo"}]
    empty = sft(tok, rows, input_key="q", output_key="a", input_template="")
    none = sft(tok, rows, input_key="q", output_key="a", input_template=None)
    assert empty.items[0].input_ids == none.items[0].input_ids
    assert empty.items[0].loss_mask == none.items[0].loss_mask
