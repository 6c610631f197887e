"""train_kto end to end on a tiny model: the loss falls; a run resumes from its checkpoint."""

from __future__ import annotations

import json
import math
import os
import random

import pytest

from rlhfkit.cli.train_kto import build_parser, main, run


def kto_rows(seed: int = 0, n: int = 5) -> list[dict]:
    """Desirable: "a+b=" -> the correct sum; undesirable: a wrong sum (string labels, as CSV files give)."""
    rng = random.Random(seed)
    rows = []
    for a in range(n):
        for b in range(n):
            wrong = rng.choice([c for c in range(2 * n - 1) if c != a + b])
            rows.append({"question": f"{a}+{b}=", "answer": str(a + b), "good": "true"})
            rows.append({"question": f"{a}+{b}=", "answer": str(wrong), "good": "false"})
    return rows


def write_jsonl(path: str, rows: list[dict]) -> str:
    with open(path, "w") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def _args(model: str, data: str, out: str, *extra: str):
    return build_parser().parse([
        "--pretrain", model, "--dataset", data, "--input_key", "question", "--output_key", "answer",
        "--label_key", "good", "--beta", "0.1", "--undesirable_loss_weight", "1.5", "--train_batch_size", "16",
        "--micro_train_batch_size", "8", "--max_epochs", "100", "--learning_rate", "3e-3", "--lr_warmup_ratio", "0",
        "--max_len", "32", "--save_path", out, "--ckpt_path", out + "_ckpt", "--disable_progress", *extra])


def test_kto_loss_falls(tiny_model_dir, tmp_path):
    data = write_jsonl(str(tmp_path / "kto.jsonl"), kto_rows())
    out = str(tmp_path / "kto")
    result = run(_args(tiny_model_dir, data, out, "--eval_dataset", data, "--max_steps", "24", "--eval_steps", "24",
                       "--logging_steps", "1"))
    hist = result.state.history
    losses = [h["train/loss"] for h in hist]
    assert sum(losses[-6:]) / 6 < sum(losses[:6]) / 6 - 0.03, losses
    # at the start policy == reference, so each answer's loss is w / 2: on the balanced eval set
    # (1 * 0.5 + 1.5 * 0.5) / 2 = 0.625
    task = result.task
    with task.ref.use() as ref_model:  # the reference's weights may be stashed between uses
        start = task.eval_metrics(ref_model, [task.collate(result.eval_items[i:i + 8])
                                              for i in range(0, len(result.eval_items), 8)])
    assert math.isclose(start["eval/loss"], 0.625, rel_tol=1e-6)
    end = hist[-1]
    assert end["step"] == 24 and end["eval/loss"] < 0.59, end
    assert end["eval/chosen_reward"] > 0 > end["eval/rejected_reward"]
    assert all(h["train/kl"] >= 0 and math.isfinite(h["train/signed_reward"]) for h in hist)
    assert os.path.isfile(os.path.join(out, "model.safetensors")) and os.path.isfile(os.path.join(out, "metrics.png"))


def test_resume_continues_from_the_checkpoint(tiny_model_dir, tmp_path):
    data = write_jsonl(str(tmp_path / "kto.jsonl"), kto_rows(n=3))
    out = str(tmp_path / "kto")
    first = run(_args(tiny_model_dir, data, out, "--max_steps", "2", "--save_steps", "2"))
    assert [h["step"] for h in first.state.history] == [1, 2]
    second = run(_args(tiny_model_dir, data, out, "--max_steps", "3", "--save_steps", "2", "--load_checkpoint"))
    assert [h["step"] for h in second.state.history] == [3]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2, 3]


def test_micro_batch_of_one_is_refused(tiny_model_dir, capsys):
    with pytest.raises(SystemExit):
        main(["--pretrain", tiny_model_dir, "--dataset", "x.jsonl", "--micro_train_batch_size", "1"])
    assert "--micro_train_batch_size must be at least 2" in capsys.readouterr().err
