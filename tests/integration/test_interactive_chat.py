"""interactive_chat: piped stdin end to end (replies, 'clear', 'exit'; the chat template by default, a plain
--input_template when given), the prompt text of a conversation (history, chat template with a system
prompt, csft suffix) worked out by hand, and which format a tokenizer gets."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from rlhfkit.cli.interactive_chat import use_chat_template
from rlhfkit.inference.chat import ChatSession, read_system_prompt
from rlhfkit.data.templates import render_chat

MAX_LEN, PENALTY = 48, 1.3


def _hf_greedy(model, tok, prompt: str) -> str:
    ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         repetition_penalty=PENALTY, max_new_tokens=MAX_LEN - ids.shape[1],
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True)


def _piped(model_dir: str, *extra: str):
    cmd = [sys.executable, "-m", "rlhfkit.cli.interactive_chat", "--pretrain", model_dir, "--greedy_sampling",
           "--max_len", str(MAX_LEN), "--repetition_penalty", str(PENALTY), "--device", "cpu", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(cmd, input="hi\nclear\nbye\nexit\nnot read\n", capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc


def test_piped_chat_clear_and_exit(tiny_model_dir):
    """The tiny tokenizer has a chat template: the turns are rendered with it, and one line says so."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    proc = _piped(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    first = _hf_greedy(model, tok, render_chat(tok, [{"role": "user", "content": "hi"}], add_generation_prompt=True))
    second = _hf_greedy(model, tok, render_chat(tok, [{"role": "user", "content": "bye"}], add_generation_prompt=True))
    assert first and second
    assert proc.stdout == f"{first}\n{second}\n"  # two replies ('clear' dropped the first); nothing after 'exit'
    assert "cleared" in proc.stderr
    assert proc.stderr.count("turns are rendered with the tokenizer's chat template") == 1


def test_piped_chat_with_input_template(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    proc = _piped(tiny_model_dir, "--input_template", "User: {}\nAssistant: ")
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    first = _hf_greedy(model, tok, "User: hi\nAssistant: ")
    second = _hf_greedy(model, tok, "User: bye\nAssistant: ")
    assert proc.stdout == f"{first}\n{second}\n" and "chat template" not in proc.stderr


def test_which_format(tiny_model_dir, capsys):
    """The chat template when the tokenizer has one and no --input_template is given (or when asked);
    the line as typed when it has none; one line says which."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert use_chat_template(tok, False, None) is True
    assert "turns are rendered with the tokenizer's chat template" in capsys.readouterr().err
    assert use_chat_template(tok, False, "Q: {}") is False and use_chat_template(tok, False, "") is False
    assert use_chat_template(tok, True, None) is True and capsys.readouterr().err == ""
    assert use_chat_template(tok, True, "Q: {}") is True
    assert "--input_template has no effect" in capsys.readouterr().err
    tok.chat_template = None
    assert use_chat_template(tok, False, None) is False
    assert "has no chat template; each turn is the line as typed" in capsys.readouterr().err


def test_conversation_text(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    plain = ChatSession(tok, system="Be brief.", input_template="User: {}\nAssistant: ")
    assert plain.prompt("hi") == "Be brief.\nUser: hi\nAssistant: "
    plain.add_turn("hi", "hello")
    assert plain.prompt("bye") == "Be brief.\nUser: hi\nAssistant: hello\nUser: bye\nAssistant: "
    plain.clear()
    assert plain.prompt("bye") == "Be brief.\nUser: bye\nAssistant: "

    chat = ChatSession(tok, system="Be brief.", apply_chat_template=True, csft_prompt="<rm_score>: 5.00")
    chat.add_turn("hi", "hello")
    assert chat.prompt("bye") == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                                  "<|im_start|>assistant\nhello<|im_end|>\n<|im_start|>user\nbye<|im_end|>\n"
                                  "<|im_start|>assistant\n <rm_score>: 5.00 ")
    chat.clear()
    assert chat.messages == [{"role": "system", "content": "Be brief."}]

    path = tmp_path / "system.txt"
    path.write_text("From a file.")
    assert read_system_prompt(str(path)) == "From a file." and read_system_prompt("Inline.") == "Inline."
