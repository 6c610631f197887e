"""One default input template for every command (the prompt as it is), declared once; the chat template
when asked for, and one line when a tokenizer's chat template is left unused (rlhfkit.data.templates)."""

from __future__ import annotations

import importlib
import logging

import pytest

from rlhfkit.config import notes
from rlhfkit.config.flags import DEFAULT_INPUT_TEMPLATE
from rlhfkit.data.io import Row
from rlhfkit.data.prompts import PromptDataConfig, PromptDataset
from rlhfkit.data.sft import SFTDataConfig, SFTDataset
from rlhfkit.models.tiny import build_tokenizer

COMMANDS = ("train_sft", "train_kd", "train_rm", "train_dpo", "train_kto", "train_ppo", "train_ppo_ray",
            "batch_inference", "interactive_chat")
UNUSED = "the tokenizer has a chat template, but --apply_chat_template is off"


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_the_one_default(command):
    parser = importlib.import_module(f"rlhfkit.cli.{command}").build_parser()
    args = parser.parse(["--pretrain", "m"])
    assert DEFAULT_INPUT_TEMPLATE is None
    assert args.input_template is DEFAULT_INPUT_TEMPLATE and args.apply_chat_template is False


@pytest.fixture
def fresh_notes(monkeypatch, caplog):
    monkeypatch.setattr(notes, "_NOTED", set())
    caplog.set_level(logging.INFO, logger="rlhfkit.config.notes")
    return caplog


def rows(*dicts):
    return [Row(d, "data.jsonl", k + 1) for k, d in enumerate(dicts)]


def test_one_line_when_a_chat_template_is_left_unused(fresh_notes):
    tok = build_tokenizer()  # has a ChatML template
    sample = PromptDataset(rows({"q": "2+2="}, {"q": "3+3="}), tok, PromptDataConfig(input_key="q")).samples[0]
    assert sample.prompt == "2+2="  # used as it is, as OpenRLHF does
    SFTDataset(rows({"q": "hi", "a": "yo"}), tok, SFTDataConfig(input_key="q", output_key="a"))
    assert fresh_notes.text.count(UNUSED) == 1  # one line for the process


@pytest.mark.parametrize("cfg", [dict(input_template="{}"), dict(input_template=""),
                                 dict(apply_chat_template=True)])
def test_no_line_when_the_format_is_chosen(fresh_notes, cfg):
    PromptDataset(rows({"q": "2+2="}), build_tokenizer(), PromptDataConfig(input_key="q", **cfg))
    assert UNUSED not in fresh_notes.text


def test_no_line_without_a_chat_template(fresh_notes):
    tok = build_tokenizer()
    tok.chat_template = None
    PromptDataset(rows({"q": "2+2="}), tok, PromptDataConfig(input_key="q"))
    assert fresh_notes.text == ""


def test_input_template_with_the_chat_template_says_it_has_no_effect(fresh_notes):
    ds = PromptDataset(rows({"q": "2+2="}), build_tokenizer(),
                       PromptDataConfig(input_key="q", input_template="Q: {}", apply_chat_template=True))
    assert ds.samples[0].prompt.startswith("<|im_start|>user\n2+2=")
    assert "--input_template has no effect: --apply_chat_template formats the prompts" in fresh_notes.text


def test_pretrain_and_multiturn_sft_say_nothing(fresh_notes):
    tok = build_tokenizer()
    SFTDataset(rows({"t": "plain"}), tok, SFTDataConfig(input_key="t", pretrain_mode=True))
    SFTDataset(rows({"m": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}), tok,
               SFTDataConfig(input_key="m", multiturn=True))
    assert fresh_notes.text == ""
