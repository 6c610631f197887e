"""rlhfkit.models.gguf_import without a model file: the chat template's end of turn, the eos / pad repair of
tokenizer, config and generation_config, the command's one-line errors, and one parse of a file (a small one
written here) per import. (A real file is imported by
`make real-model`; tests/integration/test_real_model.py runs on the result.)"""

from __future__ import annotations

import sys

import pytest
from transformers import GenerationConfig, LlamaConfig

from rlhfkit.models.gguf_import import chat_turn_end, repair_chat_eos
from rlhfkit.models.tiny import IM_END, IM_START, build_tokenizer

LLAMA2_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
                   "{% else %}{{ ' ' + m['content'] + eos_token }}{% endif %}{% endfor %}")


def test_chatml_turn_end_is_im_end():
    tok = build_tokenizer()  # ChatML template, eos </s>
    assert chat_turn_end(tok) == IM_END
    tok.chat_template = LLAMA2_TEMPLATE
    assert chat_turn_end(tok) == "</s>"
    tok.chat_template = "{{ messages[0]['content'] }}"  # the assistant's text never shows: no end of turn
    assert chat_turn_end(tok) is None
    tok.chat_template = "{{ raise_exception('only user turns') }}"
    assert chat_turn_end(tok) is None
    tok.chat_template = None
    assert chat_turn_end(tok) is None


def test_repair_sets_eos_and_missing_pad_to_the_turn_end_everywhere():
    tok = build_tokenizer()
    tok.eos_token, tok.pad_token = IM_START, None  # what transformers 5.17 reads from SmolLM2's GGUF
    im_end = tok.convert_tokens_to_ids(IM_END)
    config = LlamaConfig(vocab_size=len(tok), eos_token_id=tok.convert_tokens_to_ids(IM_START), pad_token_id=None)
    gen = GenerationConfig(eos_token_id=config.eos_token_id)
    repairs = repair_chat_eos(tok, config, gen)
    assert (tok.eos_token, tok.pad_token) == (IM_END, IM_END)
    assert (config.eos_token_id, config.pad_token_id, gen.eos_token_id, gen.pad_token_id) == (im_end,) * 4
    assert repairs[:2] == [f"tokenizer eos_token '{IM_START}' -> '{IM_END}' (the chat template's end of turn)",
                           f"tokenizer pad_token None -> '{IM_END}'"]
    assert len(repairs) == 6  # and one line per changed config / generation_config id
    assert repair_chat_eos(tok, config, gen) == []  # a repaired folder needs nothing more


def test_repair_keeps_a_pad_of_its_own_and_a_tokenizer_without_template():
    tok = build_tokenizer()  # eos </s>, pad <pad>
    pad = tok.pad_token_id
    config = LlamaConfig(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=pad)
    repair_chat_eos(tok, config, GenerationConfig())
    assert (tok.eos_token, tok.pad_token, config.pad_token_id) == (IM_END, "<pad>", pad)

    plain = build_tokenizer()
    plain.chat_template = None
    config = LlamaConfig(vocab_size=len(plain), eos_token_id=plain.eos_token_id, pad_token_id=plain.pad_token_id)
    gen = GenerationConfig(eos_token_id=plain.eos_token_id, pad_token_id=plain.pad_token_id)
    assert repair_chat_eos(plain, config, gen) == [] and plain.eos_token == "</s>"


def _cli_error(capsys, argv) -> str:
    from rlhfkit.cli.import_gguf import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_cli_errors_name_the_flag_and_the_package(capsys, monkeypatch, tmp_path):
    pytest.importorskip("gguf")
    missing = str(tmp_path / "none.gguf")
    assert _cli_error(capsys, ["--gguf", missing, "--save_path", str(tmp_path / "o")]) == \
        f"import_gguf: error: --gguf '{missing}': no such file"
    assert _cli_error(capsys, ["--gguf", str(tmp_path), "--save_path", str(tmp_path / "o")]) == \
        f"import_gguf: error: --gguf '{tmp_path}': a directory, not a .gguf file"
    junk = tmp_path / "junk.gguf"
    junk.write_text("not a model")
    err = _cli_error(capsys, ["--gguf", str(junk), "--save_path", str(tmp_path / "o")])
    assert err.startswith(f"import_gguf: error: --gguf '{junk}': transformers cannot load it as a causal LM: ")
    assert not (tmp_path / "o").exists()
    monkeypatch.setitem(sys.modules, "gguf", None)
    assert _cli_error(capsys, ["--gguf", missing, "--save_path", str(tmp_path / "o")]) == \
        "import_gguf: error: import_gguf needs the `gguf` package, which is not installed: pip install 'rlhfkit[gguf]'"


def test_a_file_is_parsed_once_within_an_import(tmp_path):
    """transformers opens the file three times (config, tokenizer, weights): within the import each path gets
    one reader, parsed once, and gguf's own reader is back afterwards."""
    gguf = pytest.importorskip("gguf")
    from rlhfkit.models import gguf_import

    path = str(tmp_path / "m.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(50)])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    real = gguf.GGUFReader
    with gguf_import._gguf_parsed_once():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(tmp_path / "m.gguf") is first  # the same file by another spelling
        assert len(first.fields["tokenizer.ggml.tokens"].data) == 50
    assert gguf.GGUFReader is real
    assert gguf.GGUFReader(path) is not first
