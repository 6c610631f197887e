"""A saved reward model scores text in plain transformers, with its own tokenizer and nothing appended
by hand, exactly as rlhfkit scores it: train_rm (tiny, a few steps), then
`AutoModelForSequenceClassification` + `AutoTokenizer` on "prompt+response" (one at a time, and a padded
batch) and `pipeline("text-classification")` equal `batch_inference --eval_task rm` on the same rows
(rlhfkit's scorer: prompt ids + response ids + EOS). Also when the base tokenizer pads with EOS (the
saved tokenizer pads with another token then, or HF would score the token before the EOS)."""

from __future__ import annotations

import json

import pytest
import torch

from rlhfkit.cli import batch_inference, train_rm
from rlhfkit.models.loader import load_tokenizer
from rlhfkit.models.value import appends_eos, load_value_model, save_value_model

ROWS = [{"input": "3+4=", "output": "7"}, {"input": "10+25=", "output": "35 I think"},
        {"input": "1+1=", "output": "3"}, {"input": "Q: what is 2+2?\nA: ", "output": "4"}]


def _write(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def rm_dir(tiny_model_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("rm_plain")
    pairs = [{"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)}
             for a in range(4) for b in range(4)]
    out = str(d / "rm")
    train_rm.run(train_rm.build_parser().parse([
        "--pretrain", tiny_model_dir, "--dataset", _write(d / "pairs.jsonl", pairs), "--prompt_key", "prompt",
        "--train_batch_size", "8", "--micro_train_batch_size", "8", "--max_steps", "3", "--learning_rate", "3e-3",
        "--lr_warmup_ratio", "0", "--max_len", "64", "--save_path", out, "--disable_progress"]))
    return out


def _rlhfkit_rewards(model_dir: str, tmp_path) -> list[float]:
    out = tmp_path / "scored.jsonl"
    batch_inference.main(["--eval_task", "rm", "--pretrain", model_dir,
                          "--dataset", _write(tmp_path / "rows.jsonl", ROWS), "--input_key", "input",
                          "--output_key", "output", "--micro_batch_size", "3",
                          "--param_dtype", "fp32", "--output_path", str(out), "--disable_progress"])
    return [json.loads(line)["reward"] for line in out.read_text().splitlines()]


def _plain_transformers(model_dir: str) -> tuple[list[float], list[float], list[float]]:
    """(one text at a time, a right-padded batch, the pipeline): the user's code, nothing rlhfkit."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, pipeline

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    texts = [r["input"] + r["output"] for r in ROWS]
    with torch.no_grad():
        single = [model(**tok(t, return_tensors="pt")).logits[0, 0].item() for t in texts]
        batch = tok(texts, padding=True, return_tensors="pt")
        assert (batch["attention_mask"] == 0).any()  # really padded
        batched = model(**batch).logits[:, 0].tolist()
    pipe = pipeline("text-classification", model=model, tokenizer=tok)
    piped = [r["score"] for r in pipe(texts)]
    return single, batched, piped


def test_train_rm_output_scores_alike_in_plain_transformers(rm_dir, tmp_path):
    want = _rlhfkit_rewards(rm_dir, tmp_path)
    assert len(set(round(w, 4) for w in want)) == len(want)  # distinct scores: a wrong token would show
    for got in _plain_transformers(rm_dir):
        assert got == pytest.approx(want, abs=1e-5)
    with open(f"{rm_dir}/config.json") as f:
        cfg = json.load(f)
    assert cfg["problem_type"] == "regression" and cfg["pad_token_id"] == load_tokenizer(rm_dir).pad_token_id


def test_without_the_eos_the_score_differs(rm_dir):
    """What the saved tokenizer fixes: the score at the last text token is not the reward."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(rm_dir)
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32).eval()
    text = ROWS[0]["input"] + ROWS[0]["output"]
    with torch.no_grad():
        with_eos = model(**tok(text, return_tensors="pt")).logits[0, 0].item()
        without = model(**tok(text, add_special_tokens=False, return_tensors="pt")).logits[0, 0].item()
    assert tok(text)["input_ids"][-1] == tok.eos_token_id and abs(with_eos - without) > 1e-3


def test_base_that_pads_with_eos(tiny_model_dir, tmp_path):
    """Llama-3-like: no pad token, so pad = eos. The saved tokenizer pads with BOS and config.pad_token_id
    says so; the batch scores still equal rlhfkit's."""
    base_tok = load_tokenizer(tiny_model_dir)
    base_tok.pad_token = base_tok.eos_token
    assert base_tok.pad_token_id == base_tok.eos_token_id and not appends_eos(base_tok)
    rm = load_value_model(tiny_model_dir, init_value_head=True)
    out = str(tmp_path / "rm")
    save_value_model(rm, out, base_tok)
    assert base_tok.pad_token_id == base_tok.eos_token_id  # the caller's tokenizer is left alone
    saved = load_tokenizer(out)
    assert saved.pad_token == saved.bos_token and appends_eos(saved)
    want = _rlhfkit_rewards(out, tmp_path)
    for got in _plain_transformers(out):
        assert got == pytest.approx(want, abs=1e-5)


def test_rlhfkit_scores_are_unchanged_by_the_saved_tokenizer(rm_dir, tiny_model_dir, tmp_path):
    """rlhfkit encodes without special tokens: the same model directory with the base tokenizer's files
    instead of the saved ones gives the same rewards."""
    import shutil

    other = tmp_path / "rm_base_tokenizer"
    shutil.copytree(rm_dir, other)
    load_tokenizer(tiny_model_dir).save_pretrained(str(other))
    assert not appends_eos(load_tokenizer(str(other))) and appends_eos(load_tokenizer(rm_dir))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert _rlhfkit_rewards(str(other), tmp_path / "a") == _rlhfkit_rewards(rm_dir, tmp_path / "b")
