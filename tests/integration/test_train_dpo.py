"""train_dpo end to end on a tiny model: preference accuracy on held-out pairs goes up.

Pairs: chosen "a+b=" -> the correct sum, rejected -> a wrong one; eval pairs use wrong answers never
seen in training.
"""

from __future__ import annotations

import json
import math
import os
import random

import pytest
import torch

from rlhfkit.cli.train_dpo import build_parser, main, run
from rlhfkit.config.configs import ModelConfig
from rlhfkit.models.loader import load_causal_lm
from rlhfkit.trainers.dpo_task import sequence_logps
from rlhfkit.trainers.rm_task import collate_pairs

# --dist loadgroup: one worker builds its trained model, not each worker that runs one of the tests
pytestmark = pytest.mark.xdist_group("train_dpo")


def addition_pairs(seed: int = 0, n: int = 5, train_wrong: int = 5, eval_wrong: int = 2):
    rng = random.Random(seed)
    train, evals = [], []
    for a in range(n):
        for b in range(n):
            wrong = [c for c in range(2 * n - 1) if c != a + b]
            rng.shuffle(wrong)
            train += [{"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(w)} for w in wrong[:train_wrong]]
            evals += [{"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(w)}
                      for w in wrong[train_wrong:train_wrong + eval_wrong]]
    return train, evals


def write_jsonl(path: str, rows: list[dict]) -> str:
    with open(path, "w") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def preference_accuracy(model, items, pad_id: int) -> float:
    """Fraction of pairs where the model gives the chosen answer a higher log-probability."""
    batch = collate_pairs(items, pad_id, packing=False)
    with torch.no_grad():
        lp, _ = sequence_logps(model.eval(), batch.seqs)
    b = batch.num_pairs
    return float((lp[:b] > lp[b:]).float().mean())


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("dpo")
    train, evals = addition_pairs()
    args = build_parser().parse([
        "--pretrain", tiny_model_dir, "--dataset", write_jsonl(str(d / "train.jsonl"), train),
        "--eval_dataset", write_jsonl(str(d / "eval.jsonl"), evals), "--prompt_key", "prompt",
        "--train_batch_size", "32", "--micro_train_batch_size", "16", "--max_epochs", "100", "--max_steps", "25",
        "--learning_rate", "3e-3", "--lr_warmup_ratio", "0", "--max_len", "32", "--beta", "0.1", "--eval_steps", "25",
        "--ref_offload", "--logging_steps", "5", "--save_path", str(d / "out"), "--ckpt_path", str(d / "ckpt"),
        "--disable_progress"])
    return run(args), str(d / "out")


def test_dpo_raises_preference_accuracy_on_held_out_pairs(trained, tiny_model_dir):
    result, out = trained
    pad = result.tokenizer.pad_token_id
    base = load_causal_lm(ModelConfig(pretrain=tiny_model_dir, param_dtype="fp32"))
    before = preference_accuracy(base, result.eval_items, pad)
    after = preference_accuracy(result.backend.model, result.eval_items, pad)
    assert after > 0.85 and after >= before + 0.2, (before, after)
    # implicit rewards: at the start (policy == reference) loss log 2 and no pair is ranked right
    task = result.task
    batches = [task.collate(result.eval_items[i:i + 16]) for i in range(0, len(result.eval_items), 16)]
    with task.ref.use() as ref_model:  # --ref_offload: the weights are stashed between uses
        start = task.eval_metrics(ref_model, batches)
    assert math.isclose(start["eval/loss"], math.log(2), rel_tol=1e-5) and start["eval/acc"] == 0.0
    end = result.state.history[-1]
    assert end["step"] == 25 and end["eval/acc"] > 0.85 and end["eval/loss"] < math.log(2) - 0.1
    assert end["eval/margin"] > 0 and end["eval/chosen_reward"] > end["eval/rejected_reward"]


def test_logged_metrics_and_saved_policy(trained):
    from transformers import AutoModelForCausalLM

    result, out = trained
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    train_recs = [r for r in records if "train/acc" in r]
    assert [r["step"] for r in train_recs] == [5, 10, 15, 20, 25]
    for k in ("train/loss", "train/chosen_reward", "train/rejected_reward", "train/margin", "train/lr",
              "train/grad_norm"):
        assert all(isinstance(r[k], float) for r in train_recs), k
    assert all(math.isclose(r["train/margin"], r["train/chosen_reward"] - r["train/rejected_reward"], abs_tol=1e-6)
               for r in train_recs)
    with open(os.path.join(out, "run_config.json")) as f:
        assert json.load(f)["beta"] == 0.1
    saved = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([result.train_items[0].chosen_ids])
    with torch.no_grad():
        torch.testing.assert_close(saved(ids).logits, result.backend.model(ids).logits, atol=1e-5, rtol=1e-5)


def test_ipo_cdpo_nll_and_packing_run(tiny_model_dir, tmp_path):
    train, _ = addition_pairs(n=3, train_wrong=2)
    data = write_jsonl(str(tmp_path / "t.jsonl"), train)
    for i, extra in enumerate((["--ipo"], ["--label_smoothing", "0.1", "--nll_loss_coef", "0.5", "--packing_samples"])):
        args = build_parser().parse([
            "--pretrain", tiny_model_dir, "--dataset", data, "--prompt_key", "prompt", "--train_batch_size", "8",
            "--micro_train_batch_size", "4", "--max_steps", "2", "--learning_rate", "1e-3", "--max_len", "64",
            "--save_path", str(tmp_path / f"o{i}"), "--disable_progress", *extra])
        hist = run(args).state.history
        assert [h["step"] for h in hist] == [1, 2] and all(math.isfinite(h["train/loss"]) for h in hist)
        if "--nll_loss_coef" in extra:
            assert all(h["train/nll_loss"] > 0 for h in hist)


def test_bad_flag_combination_is_one_clear_error(tiny_model_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--pretrain", tiny_model_dir, "--dataset", "x.jsonl", "--ipo", "--label_smoothing", "0.1"])
    assert e.value.code == 1
    assert "train_dpo: error: --label_smoothing (cDPO) cannot be combined with --ipo" in capsys.readouterr().err
