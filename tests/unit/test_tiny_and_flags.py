import pytest
import torch

from rlhfkit.config.flags import FlagParser, add_model_flags, add_train_flags


def test_tiny_model_loads_with_auto_classes(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = tok("12+34=46")["input_ids"]
    assert tok.decode(ids) == "12+34=46" and len(ids) == 8
    assert tok.pad_token_id is not None and tok.eos_token_id is not None
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    out = model(torch.tensor([ids]))
    assert out.logits.shape == (1, 8, len(tok))


def _parser():
    p = FlagParser("t")
    add_model_flags(p)
    add_train_flags(p)
    return p


def test_dotted_alias_and_flat_name_share_dest():
    a = _parser().parse(["--model.model_name_or_path", "x", "--adam.lr", "3e-4"])
    b = _parser().parse(["--pretrain", "x", "--learning_rate", "3e-4"])
    assert a.pretrain == b.pretrain == "x" and a.learning_rate == b.learning_rate == 3e-4


def test_bf16_alias():
    assert _parser().parse(["--bf16"]).param_dtype == "bf16"
    assert _parser().parse(["--param_dtype", "fp32"]).param_dtype == "fp32"


def test_unknown_flag_suggests_closest(capsys):
    with pytest.raises(SystemExit) as e:
        _parser().parse(["--lerning_rate", "1e-5"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--lerning_rate" in err and "did you mean --learning_rate" in err
