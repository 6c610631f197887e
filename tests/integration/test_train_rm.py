"""train_rm end to end on a tiny model: learns "a+b=c" correctness, saves an HF reward model that scores alike.

Data: chosen answers are the correct sum, rejected ones wrong sums; eval pairs use wrong answers
that never appear in training, so eval accuracy needs the model to prefer the correct sum itself.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys

import pytest
import torch

from rlhfkit.cli.train_rm import build_parser, main, run
from rlhfkit.data.collate import pad_batch
from rlhfkit.data.items import SFTItem
from rlhfkit.data.preference import preference_rows
from rlhfkit.trainers.rm_task import collate_seqs, last_token_rewards

# --dist loadgroup: one worker builds its trained model, not each worker that runs one of the tests
pytestmark = pytest.mark.xdist_group("train_rm")

N, TRAIN_WRONG, EVAL_WRONG = 5, 5, 2  # a, b in 0..4; wrong answers per question


def addition_pairs(seed: int = 0, chat: bool = False) -> tuple[list[dict], list[dict]]:
    """(train, eval) preference rows; per question the wrong answers are split between train and eval."""
    rng = random.Random(seed)
    train, evals = [], []
    for a in range(N):
        for b in range(N):
            wrong = [c for c in range(2 * N - 1) if c != a + b]
            rng.shuffle(wrong)
            for split, ws in ((train, wrong[:TRAIN_WRONG]), (evals, wrong[TRAIN_WRONG:TRAIN_WRONG + EVAL_WRONG])):
                for w in ws:
                    if chat:
                        user = {"role": "user", "content": f"{a}+{b}="}
                        split.append({"chosen": [user, {"role": "assistant", "content": str(a + b)}],
                                      "rejected": [user, {"role": "assistant", "content": str(w)}]})
                    else:
                        split.append({"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(w)})
    return train, evals


def write_jsonl(path: str, rows: list[dict]) -> str:
    with open(path, "w") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("rm")
    train, evals = addition_pairs()
    out = str(d / "rm")
    args = build_parser().parse([
        "--pretrain", tiny_model_dir, "--dataset", write_jsonl(str(d / "train.jsonl"), train),
        "--eval_dataset", write_jsonl(str(d / "eval.jsonl"), evals), "--prompt_key", "prompt",
        "--train_batch_size", "32", "--micro_train_batch_size", "16", "--max_epochs", "100", "--max_steps", "90",
        "--learning_rate", "3e-3", "--lr_warmup_ratio", "0", "--max_len", "32", "--eval_steps", "45",
        "--logging_steps", "10", "--save_path", out, "--ckpt_path", str(d / "ckpt"), "--disable_progress"])
    return run(args), out


def test_eval_accuracy_above_0_9(trained):
    result, out = trained
    evals = [h for h in result.state.history if "eval/acc" in h]
    assert [h["step"] for h in evals] == [45, 90]
    assert evals[-1]["eval/acc"] > 0.9, evals
    assert evals[-1]["eval/loss"] < 0.5
    with open(os.path.join(out, "metrics.jsonl")) as f:
        logged = [json.loads(line) for line in f]
    assert any(r.get("eval/acc") == evals[-1]["eval/acc"] for r in logged)
    assert os.path.isfile(os.path.join(out, "metrics.png"))
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["value_head_prefix"] == "score" and cfg["architectures"] == ["LlamaForSequenceClassification"]


def _sequences(result) -> list:
    """Every eval chosen, then every rejected answer, then texts of other lengths (so batches are padded)."""
    tok = result.tokenizer
    extra = []
    for text in ("12+34=46", "1+1=2", "hello world", "3"):
        ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        extra.append(SFTItem(ids, [0] + [1] * (len(ids) - 1)))
    return preference_rows(result.eval_items) + extra


@pytest.mark.parametrize("side,packing", [("right", False), ("left", True)])
def test_saved_model_reloads_and_scores_like_the_trainer(trained, side, packing):
    from transformers import AutoModelForSequenceClassification

    result, out = trained
    seqs = _sequences(result)
    with torch.no_grad():  # the trainer's scoring, on its own (padded or packed) batch
        trainer_scores = last_token_rewards(result.backend.model.eval(),
                                            collate_seqs(seqs, result.tokenizer.pad_token_id, packing))
    hf = AutoModelForSequenceClassification.from_pretrained(out, num_labels=1).eval()
    batch = pad_batch(seqs, result.tokenizer.pad_token_id, side=side)
    assert (batch.attention_mask == 0).any()  # really padded
    with torch.no_grad():
        hf_scores = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, 0]
    torch.testing.assert_close(hf_scores, trainer_scores, atol=1e-5, rtol=0)


def test_config_stores_mean_and_std_of_eval_scores(trained):
    from transformers import AutoModelForSequenceClassification

    from rlhfkit.models.value import load_value_model, reward_at_last_token

    result, out = trained
    hf = AutoModelForSequenceClassification.from_pretrained(out, num_labels=1).eval()
    batch = pad_batch(preference_rows(result.eval_items), result.tokenizer.pad_token_id)
    with torch.no_grad():
        scores = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, 0].double()
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    assert abs(cfg["mean"] - scores.mean().item()) < 1e-4
    assert abs(cfg["std"] - scores.std().item()) < 1e-4 and cfg["std"] > 0.1
    normed = load_value_model(out, normalize_reward=True).eval()
    with torch.no_grad():
        got = reward_at_last_token(normed(batch.input_ids, batch.attention_mask), batch.attention_mask)
    torch.testing.assert_close(got.double(), (scores - cfg["mean"]) / cfg["std"], atol=1e-4, rtol=0)


def test_seed_command_as_subprocess(tiny_long_model_dir, tmp_path):
    """The README's RM command (minus wandb), pointed at the tiny model and a local chat-format jsonl."""
    train, _ = addition_pairs(chat=True)
    data = write_jsonl(str(tmp_path / "prefs.jsonl"), train[:16])
    out = str(tmp_path / "llama3-8b-rm")
    cmd = [sys.executable, "-m", "rlhfkit.cli.train_rm", "--save_path", out, "--save_steps", "-1",
           "--logging_steps", "1", "--eval_steps", "-1", "--train_batch_size", "8", "--micro_train_batch_size", "1",
           "--pretrain", tiny_long_model_dir, "--param_dtype", "bf16", "--max_epochs", "1", "--max_len", "8192",
           "--zero_stage", "3", "--learning_rate", "9e-6", "--dataset", data, "--apply_chat_template",
           "--chosen_key", "chosen", "--rejected_key", "rejected", "--packing_samples", "--gradient_checkpointing",
           "--value_prefix_head", "score", "--ckpt_path", str(tmp_path / "ckpt")]
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records if "train/loss" in r] == [1, 2]
    assert any("train/reward_mean" in r for r in records)
    with open(os.path.join(out, "config.json")) as f:  # the model's config, with the reward statistics
        cfg = json.load(f)
    assert cfg["value_head_prefix"] == "score" and cfg["std"] > 0 and "mean" in cfg
    with open(os.path.join(out, "run_config.json")) as f:  # every flag's resolved value
        run_cfg = json.load(f)
    assert run_cfg["packing_samples"] is True and run_cfg["zero_stage"] == 3 and run_cfg["max_len"] == 8192
    assert os.path.isfile(os.path.join(out, "model.safetensors"))


def test_dotted_aliases_parse_like_flat_flags():
    flat = build_parser().parse([
        "--pretrain", "m", "--value_head_prefix", "value_head", "--compute_fp32_loss", "--margin_loss",
        "--loss", "logexp", "--prompt_key", "p", "--chosen_key", "c", "--rejected_key", "r", "--max_len", "64",
        "--micro_train_batch_size", "2", "--max_epochs", "3", "--learning_rate", "1e-4", "--ckpt_path", "ck",
        "--packing_samples", "--apply_chat_template"])
    dotted = build_parser().parse([
        "--model.model_name_or_path", "m", "--ds.value_head_prefix", "value_head", "--model.compute_fp32_loss_enable",
        "--model.margin_loss_enable", "--model.loss_type", "logexp", "--data.prompt_key", "p", "--data.chosen_key",
        "c", "--data.rejected_key", "r", "--data.max_len", "64", "--train.micro_batch_size", "2",
        "--train.max_epochs", "3", "--adam.lr", "1e-4", "--ckpt.path", "ck", "--ds.packing_samples",
        "--data.apply_chat_template"])
    assert vars(flat) == vars(dotted)
    defaults = build_parser().parse([])
    assert (defaults.value_head_prefix, defaults.loss, defaults.max_len, defaults.micro_train_batch_size,
            defaults.learning_rate) == ("score", "sigmoid", 512, 1, 9e-6)


def test_bad_input_is_one_clear_error(tiny_model_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--pretrain", tiny_model_dir, "--dataset", str(tmp_path / "missing.jsonl"), "--max_len", "64",
              "--save_path", str(tmp_path / "o")])
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert "train_rm: error:" in err and "missing.jsonl" in err
    bad = write_jsonl(str(tmp_path / "bad.jsonl"), [{"chosen": "1", "rejected": "2"}, {"chosen": "1"}])
    with pytest.raises(SystemExit):
        main(["--pretrain", tiny_model_dir, "--dataset", bad, "--max_len", "64", "--save_path", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert "bad.jsonl row 2" in err and "'rejected'" in err and "--rejected_key" in err


def test_lora_reward_model_merges_into_a_loadable_model(tiny_model_dir, tmp_path):
    """--lora_rank: the adapter is saved with the reward config; lora_combiner --is_rm gives an HF reward model."""
    from transformers import AutoModelForSequenceClassification

    from rlhfkit.models.lora_merge import merge_lora

    train, evals = addition_pairs()
    out = str(tmp_path / "rm_lora")
    result = run(build_parser().parse([
        "--pretrain", tiny_model_dir, "--dataset", write_jsonl(str(tmp_path / "t.jsonl"), train[:32]),
        "--prompt_key", "prompt", "--train_batch_size", "16", "--micro_train_batch_size", "8", "--max_steps", "2",
        "--learning_rate", "3e-3", "--lora_rank", "4", "--max_len", "64", "--save_path", out, "--disable_progress"]))
    assert os.path.isfile(os.path.join(out, "adapter_config.json"))
    merged = merge_lora(tiny_model_dir, out, str(tmp_path / "merged"), is_rm=True, param_dtype="fp32")
    with open(os.path.join(merged, "config.json")) as f:
        cfg = json.load(f)
    assert math.isclose(cfg["mean"], result.extra["mean"]) and math.isclose(cfg["std"], result.extra["std"])
    seqs = preference_rows(result.train_items[:8])
    batch = pad_batch(seqs, result.tokenizer.pad_token_id)
    hf = AutoModelForSequenceClassification.from_pretrained(merged, num_labels=1).eval()
    with torch.no_grad():
        trainer = last_token_rewards(result.backend.model.eval(), batch)
        theirs = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, 0]
    torch.testing.assert_close(theirs, trainer, atol=1e-4, rtol=1e-4)


def test_custom_value_head_prefix_is_saved(tiny_model_dir, tmp_path):
    from safetensors import safe_open

    from rlhfkit.models.value import load_value_model

    train, _ = addition_pairs()
    out = str(tmp_path / "rm_vh")
    run(build_parser().parse([
        "--pretrain", tiny_model_dir, "--dataset", write_jsonl(str(tmp_path / "t.jsonl"), train[:16]),
        "--prompt_key", "prompt", "--train_batch_size", "16", "--micro_train_batch_size", "16", "--max_steps", "1",
        "--value_head_prefix", "value_head", "--max_len", "64", "--save_path", out, "--disable_progress"]))
    with safe_open(os.path.join(out, "model.safetensors"), framework="pt") as f:
        assert "value_head.weight" in f.keys() and "score.weight" not in f.keys()
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["value_head_prefix"] == "value_head"
    assert load_value_model(out).get_value_head().weight.shape == (1, 64)  # the stored prefix is found
