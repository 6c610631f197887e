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

# --dist loadgroup: one worker builds its reward models (one on SmolLM2), not each worker that runs one of the tests
pytestmark = pytest.mark.xdist_group("rm_plain_transformers")

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


# ----------------------------------------------------------------------------- chat rows

def _chat_pairs(n: int = 4) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": f"{a}+{b}="}], "chosen": str(a + b), "rejected": str(a + b + 1)}
            for a in range(n) for b in range(n)]


HELD_OUT = {"prompt": [{"role": "user", "content": "7+9="}], "chosen": "16", "rejected": "17"}


@pytest.fixture(scope="module", params=["tiny", "smollm2_like", "gemma3_like", "smollm2_real"])
def chat_rm(request, tiny_model_dir, tmp_path_factory):
    """(base model dir, reward model trained on chat rows with --apply_chat_template): the tiny model's ChatML
    (EOS `</s>` after `<|im_end|>`), SmolLM2's (EOS is `<|im_end|>`: SmolLM2-135M-Instruct itself, one step,
    when tests/real_model.py finds it, and a tiny model with its tokenizer's shape) and Gemma 3's (adds `<bos>`,
    which its template writes too; EOS `<eos>` after `<end_of_turn>`)."""
    from tokenizer_kinds import gemma3_like, save_tiny_model, smollm2_like

    d = tmp_path_factory.mktemp(f"rm_chat_{request.param}")
    if request.param == "smollm2_real":
        from real_model import real_model_path

        base, steps, pairs = real_model_path(), "1", _chat_pairs(2)
    else:
        make = {"tiny": None, "smollm2_like": smollm2_like, "gemma3_like": gemma3_like}[request.param]
        base = tiny_model_dir if make is None else save_tiny_model(make(), str(d / "base"))
        steps, pairs = "3", _chat_pairs()
    out = str(d / "rm")
    train_rm.run(train_rm.build_parser().parse([
        "--pretrain", base, "--dataset", _write(d / "pairs.jsonl", pairs), "--prompt_key", "prompt",
        "--apply_chat_template", "--train_batch_size", "4", "--micro_train_batch_size", "4", "--max_steps", steps,
        "--learning_rate", "3e-3", "--lr_warmup_ratio", "0", "--max_len", "128", "--save_path", out,
        "--param_dtype", "fp32", "--disable_progress"]))
    return base, out


def _training_ids(base: str) -> list[list[int]]:
    """The held-out pair's chosen and rejected ids as train_rm builds them from its base tokenizer."""
    from rlhfkit.data.io import Row
    from rlhfkit.data.preference import PreferenceDataConfig, PreferenceDataset

    ds = PreferenceDataset([Row(HELD_OUT, "held_out.jsonl", 1)], load_tokenizer(base),
                           PreferenceDataConfig(prompt_key="prompt", apply_chat_template=True, max_len=128))
    return [ds[0].chosen_ids, ds[0].rejected_ids]


def _rlhfkit_scores(rm: str, ids: list[list[int]]) -> list[float]:
    from rlhfkit.models.value import reward_at_last_token

    model = load_value_model(rm, dtype=torch.float32).eval()
    with torch.no_grad():
        out = []
        for row in ids:
            t = torch.tensor([row])
            out.append(reward_at_last_token(model(input_ids=t, attention_mask=torch.ones_like(t)),
                                            torch.ones_like(t)).item())
    return out


def _docs_texts(tok) -> list[str]:
    """What docs/rm.md tells users to pass: the conversation through the saved tokenizer's chat template."""
    return [tok.apply_chat_template(HELD_OUT["prompt"] + [{"role": "assistant", "content": HELD_OUT[k]}],
                                    tokenize=False) for k in ("chosen", "rejected")]


def test_chat_rm_scores_apply_chat_template_text_as_training_did(chat_rm):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, pipeline

    base, rm = chat_rm
    want_ids = _training_ids(base)
    want = _rlhfkit_scores(rm, want_ids)
    tok = AutoTokenizer.from_pretrained(rm)
    texts = _docs_texts(tok)
    assert [list(tok(t)["input_ids"]) for t in texts] == want_ids  # the very ids training scored
    model = AutoModelForSequenceClassification.from_pretrained(rm, dtype=torch.float32).eval()
    with torch.no_grad():
        single = [model(**tok(t, return_tensors="pt")).logits[0, 0].item() for t in texts]
        batched = model(**tok(texts, padding=True, return_tensors="pt")).logits[:, 0].tolist()
    piped = [r["score"] for r in pipeline("text-classification", model=model, tokenizer=tok)(texts)]
    for got in (single, batched, piped):
        assert got == pytest.approx(want, abs=1e-4)
    base_tok = load_tokenizer(base)
    if base_tok.bos_token == "<bos>":  # Gemma: the template's <bos>, once
        assert want_ids[0][0] == base_tok.bos_token_id and want_ids[0].count(base_tok.bos_token_id) == 1


def test_the_base_template_with_an_appended_eos_scores_otherwise(chat_rm):
    """What a saved tokenizer that only appended EOS gave (the issue: a second `<|im_end|>` after the
    template's newline): other ids and, past 1e-4, another score."""
    from transformers import AutoModelForSequenceClassification

    base, rm = chat_rm
    base_tok = load_tokenizer(base)
    text = _docs_texts(base_tok)[0]
    ids = list(base_tok(text)["input_ids"]) + [base_tok.eos_token_id]
    assert ids != _training_ids(base)[0]
    model = AutoModelForSequenceClassification.from_pretrained(rm, dtype=torch.float32).eval()
    with torch.no_grad():
        old = model(input_ids=torch.tensor([ids])).logits[0, 0].item()
    assert abs(old - _rlhfkit_scores(rm, _training_ids(base))[0]) > 1e-4


def test_the_saved_chat_template_renders_prompts_as_before(chat_rm):
    """Only a conversation ending with the assistant's answer renders otherwise; saving the reward model
    again (lora_combiner, a checkpoint's copy) keeps the template as it is."""
    from rlhfkit.models.scoring_tokenizer import scoring_tokenizer

    base, rm = chat_rm
    base_tok, saved = load_tokenizer(base), load_tokenizer(rm)
    for msgs, gen in ((HELD_OUT["prompt"], True), (HELD_OUT["prompt"], False)):
        assert (saved.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
                == base_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen))
    again = scoring_tokenizer(saved)
    assert again.chat_template == saved.chat_template and _docs_texts(again) == _docs_texts(saved)
