"""Reward/critic model: parity with AutoModelForSequenceClassification, padding, save/load, normalisation."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from safetensors import safe_open

from rlhfkit.models.loader import load_tokenizer
from rlhfkit.models.value import (
    last_token_index,
    load_value_model,
    positions_from_mask,
    reward_at_last_token,
    save_value_model,
)

TEXTS = ["hello world, this is a reward", "ab", "12+34=46", "<|im_start|>user\nhi<|im_end|>"]


def _batch(tok, side: str):
    tok.padding_side = side
    return tok(TEXTS, return_tensors="pt", padding=True, add_special_tokens=False)


def test_last_token_and_positions_by_hand():
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1], [0, 0, 1, 0]])
    values = torch.tensor([[1.0, 2.0, 3.0, 9.0], [9.0, 5.0, 6.0, 7.0], [9.0, 9.0, 4.0, 9.0]])
    assert last_token_index(mask).tolist() == [2, 3, 2]
    assert reward_at_last_token(values, mask).tolist() == [3.0, 7.0, 4.0]
    assert positions_from_mask(mask).tolist() == [[0, 1, 2, 2], [0, 0, 1, 2], [0, 0, 0, 0]]


@pytest.fixture(scope="module")
def rm_dir(tiny_model_dir, tmp_path_factory):
    """A reward model with a fresh head, saved with mean/std in its config."""
    torch.manual_seed(0)
    model = load_value_model(tiny_model_dir, init_value_head=True)
    path = str(tmp_path_factory.mktemp("rm"))
    save_value_model(model, path, load_tokenizer(tiny_model_dir), mean=0.25, std=2.0)
    return path


@pytest.mark.parametrize("side", ["left", "right"])
def test_scores_equal_sequence_classification_logits(rm_dir, side):
    from transformers import AutoModelForSequenceClassification

    tok = load_tokenizer(rm_dir)
    ref = AutoModelForSequenceClassification.from_pretrained(rm_dir, num_labels=1).eval()
    model = load_value_model(rm_dir).eval()
    b = _batch(tok, side)
    assert (b["attention_mask"] == 0).any()  # the batch really is padded
    with torch.no_grad():
        values = model(b["input_ids"], b["attention_mask"])
        ours = reward_at_last_token(values, b["attention_mask"])
        theirs = ref(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits.squeeze(-1)
        # padding invariance: each text alone, unpadded
        alone = torch.stack([model(torch.tensor([ids]))[0, -1] for ids in
                             tok(TEXTS, add_special_tokens=False)["input_ids"]])
    assert values.shape == b["input_ids"].shape
    assert torch.all(values[b["attention_mask"] == 0] == 0)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours, alone, atol=1e-5, rtol=0)


def test_qwen2_parity(tiny_qwen2_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification

    save_value_model(load_value_model(tiny_qwen2_dir, init_value_head=True), str(tmp_path),
                     load_tokenizer(tiny_qwen2_dir))
    tok = load_tokenizer(str(tmp_path))
    ref = AutoModelForSequenceClassification.from_pretrained(str(tmp_path), num_labels=1).eval()
    model = load_value_model(str(tmp_path)).eval()
    b = _batch(tok, "left")
    with torch.no_grad():
        ours = reward_at_last_token(model(b["input_ids"], b["attention_mask"]), b["attention_mask"])
        theirs = ref(**b).logits.squeeze(-1)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


def test_saved_config_and_normalisation(rm_dir):
    with open(os.path.join(rm_dir, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["value_head_prefix"] == "score" and cfg["mean"] == 0.25 and cfg["std"] == 2.0
    assert cfg["normalize_reward"] is False and cfg["pad_token_id"] == 0
    assert cfg["architectures"] == ["LlamaForSequenceClassification"]
    tok = load_tokenizer(rm_dir)
    b = _batch(tok, "right")
    with torch.no_grad():
        raw = reward_at_last_token(load_value_model(rm_dir)(**b), b["attention_mask"])
        norm = reward_at_last_token(load_value_model(rm_dir, normalize_reward=True)(**b), b["attention_mask"])
    torch.testing.assert_close(norm, (raw - 0.25) / 2.0)


def test_round_trip_keeps_weights_and_new_stats(rm_dir, tmp_path):
    model = load_value_model(rm_dir)
    save_value_model(model, str(tmp_path), mean=-1.0, std=3.0, normalize_reward=True)
    again = load_value_model(str(tmp_path))
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), again.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)
    assert (again.config.mean, again.config.std) == (-1.0, 3.0)
    assert again.config.normalize_reward is False  # the load argument decides, as in OpenRLHF


def test_custom_head_prefix(tiny_model_dir, tmp_path):
    model = load_value_model(tiny_model_dir, value_head_prefix="value_head", init_value_head=True)
    assert not hasattr(model, "score") and model.get_value_head().weight.shape == (1, 64)
    save_value_model(model, str(tmp_path))
    with safe_open(os.path.join(tmp_path, "model.safetensors"), framework="pt") as f:
        assert "value_head.weight" in f.keys() and "score.weight" not in f.keys()
    again = load_value_model(str(tmp_path), value_head_prefix="score")  # the stored prefix wins
    assert torch.equal(again.get_value_head().weight, model.get_value_head().weight)


def test_fresh_head_init_and_missing_head_error(tiny_model_dir):
    with pytest.raises(ValueError, match="--value_head_prefix"):
        load_value_model(tiny_model_dir)
    torch.manual_seed(1)
    w = load_value_model(tiny_model_dir, init_value_head=True).get_value_head().weight
    expected = 1 / math.sqrt(64 + 1)  # N(0, 1/(H+1)) as OpenRLHF
    assert 0.7 * expected < w.std().item() < 1.3 * expected


def test_critic_values_train(rm_dir):
    """Per-token values take gradients through the backbone and the head."""
    tok = load_tokenizer(rm_dir)
    model = load_value_model(rm_dir).train()
    b = _batch(tok, "right")
    values = model(**b)
    (values * b["attention_mask"]).sum().backward()
    assert model.score.weight.grad.abs().sum() > 0
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


def test_bf16_dtype(rm_dir):
    model = load_value_model(rm_dir, dtype="bf16")
    assert model.score.weight.dtype == torch.bfloat16
    b = _batch(load_tokenizer(rm_dir), "right")
    assert model(**b).dtype == torch.float32


def test_pickle_round_trip(rm_dir):
    """The dynamic class pickles by reference to rlhfkit.models.value (not to the stock HF class)."""
    import pickle

    model = load_value_model(rm_dir).eval()
    again = pickle.loads(pickle.dumps(model))
    assert type(again) is type(model) and type(model).__name__ == "LlamaForSequenceClassification"
    b = _batch(load_tokenizer(rm_dir), "right")
    with torch.no_grad():
        torch.testing.assert_close(again(**b), model(**b))
